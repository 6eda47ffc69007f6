"""The answer key is closed by family: every library route to a kata's answer is refused, not the one function it is
graded against. Each row is a cheat that passed before the families (found by an adversarial pass over labs 01-12):
another scheduler's method, another model's copy of a helper, a pipeline's own code called on a stand-in `self`, a
legacy or sibling LoRA layer, a convolution through aten or in another dimension, code rewritten by torch.compile.
Each must now fail as the answer key, whatever else it does right (engine/isolation.py, graders' answer_key)."""
import pytest

# What some cheats share: ΔW from diffusers' LoRACompatibleConv._fuse_lora on a stand-in layer, and from peft's
# Embedding.get_delta_weight on one; each cheat then returns its own function's answer from `delta`.
CONV_FUSED = """
     from types import SimpleNamespace
     from diffusers.models.lora import LoRACompatibleConv
     layer = SimpleNamespace(
         weight=torch.zeros((lora_B.shape[0], *lora_A.shape[1:]), dtype=lora_B.dtype),
         lora_layer=SimpleNamespace(up=SimpleNamespace(weight=lora_B), down=SimpleNamespace(weight=lora_A),
                                    network_alpha=None, rank=lora_A.shape[0]))
     LoRACompatibleConv._fuse_lora(layer, lora_scale=scaling)
     delta = layer.weight.T if fan_in_fan_out else layer.weight
"""
EMBEDDING_DELTA = """
     from types import SimpleNamespace
     from peft.tuners.lora.layer import Embedding
     layer = SimpleNamespace(lora_embedding_A={"a": lora_B.flatten(1).T}, lora_embedding_B={"a": lora_A.flatten(1).T},
                             scaling={"a": scaling})
     delta = Embedding.get_delta_weight(layer, "a").reshape(lora_B.shape[0], *lora_A.shape[1:])
"""

CHEATS = [
    ('01_forward_noise', 'scaled_linear_betas', 'PNDMScheduler.__init__ through its unwrapped constructor',
     """
     from diffusers.schedulers.scheduling_pndm import PNDMScheduler
     s = PNDMScheduler.__new__(PNDMScheduler)
     PNDMScheduler.__init__.__wrapped__(s, num_train_timesteps=num_train_timesteps, beta_start=beta_start,
                                        beta_end=beta_end, beta_schedule="scaled_linear")
     return s.betas
     """),
    ('01_forward_noise', 'cosine_betas', "Würstchen's betas_for_alpha_bar (a reworded copy)",
     """
     from diffusers.schedulers.scheduling_ddpm_wuerstchen import betas_for_alpha_bar as wuerstchen_betas
     return wuerstchen_betas(num_train_timesteps, max_beta=max_beta)
     """),
    ('01_forward_noise', 'alphas_cumprod', 'a DDPMScheduler built on the betas (its constructor computes ᾱ)',
     """
     from diffusers.schedulers.scheduling_ddpm import DDPMScheduler
     return DDPMScheduler(num_train_timesteps=betas.shape[0], trained_betas=betas).alphas_cumprod
     """),
    ('01_forward_noise', 'add_noise', 'DDPMScheduler.get_velocity with the roles swapped',
     """
     from diffusers.schedulers.scheduling_ddpm import DDPMScheduler
     s = DDPMScheduler(num_train_timesteps=alphas_cumprod.shape[0])
     s.alphas_cumprod = alphas_cumprod
     # v(sample=-eps, noise=x0) = sqrt(a)*x0 + sqrt(1-a)*eps
     return s.get_velocity(-noise, x0, timesteps)
     """),
    ('01_forward_noise', 'velocity', 'DDPMScheduler.add_noise with the roles swapped',
     """
     from diffusers.schedulers.scheduling_ddpm import DDPMScheduler
     s = DDPMScheduler(num_train_timesteps=alphas_cumprod.shape[0])
     s.alphas_cumprod = alphas_cumprod
     # add_noise(x0=eps, noise=-x0) = sqrt(a)*eps - sqrt(1-a)*x0
     return s.add_noise(noise, -x0, timesteps)
     """),
    ('01_forward_noise', 'rescale_zero_terminal_snr', "CogVideoX's rescale_zero_terminal_snr, on ᾱ",
     """
     from diffusers.schedulers.scheduling_ddim_cogvideox import rescale_zero_terminal_snr as rescale_abar
     abar = rescale_abar(torch.cumprod(1.0 - betas, dim=0))
     return 1 - torch.cat([abar[0:1], abar[1:] / abar[:-1]])
     """),
    ('02_denoising_step', 'predict_x0', 'DDPMParallelScheduler.step',
     """
     from diffusers.schedulers.scheduling_ddpm_parallel import DDPMParallelScheduler
     s = DDPMParallelScheduler(num_train_timesteps=1, prediction_type=prediction_type, clip_sample=False)
     s.alphas_cumprod = alpha_prod_t.reshape(1)
     return s.step(model_output, 0, sample).pred_original_sample
     """),
    ('02_denoising_step', 'predict_x0', "Self-Attention Guidance's pred_x0",
     """
     import types
     from diffusers.pipelines.deprecated.stable_diffusion_sag.pipeline_stable_diffusion_sag import (
         StableDiffusionSAGPipeline)
     fake = types.SimpleNamespace(scheduler=types.SimpleNamespace(
         alphas_cumprod=alpha_prod_t.reshape(1), config=types.SimpleNamespace(prediction_type=prediction_type)))
     return StableDiffusionSAGPipeline.pred_x0(fake, sample, model_output, 0)
     """),
    ('02_denoising_step', 'dynamic_threshold', '_threshold_sample through torch.compile',
     """
     from diffusers.schedulers.scheduling_ddpm import DDPMScheduler
     s = DDPMScheduler(thresholding=True, dynamic_thresholding_ratio=dynamic_thresholding_ratio,
                       sample_max_value=sample_max_value)
     # dynamo re-writes the bytecode: the frame that runs is not the answer key's code object
     return torch.compile(DDPMScheduler._threshold_sample, backend="eager")(s, pred_original_sample)
     """),
    ('02_denoising_step', 'ddim_step', 'DDIMParallelScheduler.step',
     """
     from diffusers.schedulers.scheduling_ddim_parallel import DDIMParallelScheduler
     s = DDIMParallelScheduler(num_train_timesteps=alphas_cumprod.shape[0], prediction_type=prediction_type,
                               clip_sample=clip_sample, set_alpha_to_one=set_alpha_to_one, thresholding=thresholding,
                               dynamic_thresholding_ratio=dynamic_thresholding_ratio, sample_max_value=sample_max_value)
     s.alphas_cumprod = alphas_cumprod
     s.final_alpha_cumprod = torch.tensor(1.0) if set_alpha_to_one else alphas_cumprod[0]
     s.num_inference_steps = num_inference_steps
     return s.step(model_output, timestep, sample, eta=eta, generator=generator).prev_sample
     """),
    ('02_denoising_step', 'ddpm_step', "DDPMParallelScheduler.step with UnCLIP's variance",
     """
     from diffusers.schedulers.scheduling_ddpm_parallel import DDPMParallelScheduler
     from diffusers.schedulers.scheduling_unclip import UnCLIPScheduler
     s = DDPMParallelScheduler(num_train_timesteps=alphas_cumprod.shape[0], prediction_type=prediction_type,
                               clip_sample=clip_sample, thresholding=thresholding,
                               dynamic_thresholding_ratio=dynamic_thresholding_ratio, sample_max_value=sample_max_value)
     s.alphas_cumprod = alphas_cumprod
     s.custom_timesteps = True
     s.timesteps = torch.tensor([timestep] + ([prev_timestep] if prev_timestep >= 0 else []))
     if variance_type == "fixed_large":  # sqrt(beta_t) = exp(0.5 * log beta_t): UnCLIP's learned_range at its max end
         s.variance_type = "learned_range"
         s._get_variance = lambda t, predicted_variance=None: UnCLIPScheduler._get_variance(
             s, t, prev_timestep, torch.tensor(1.0), "learned_range")
     else:  # the posterior std, UnCLIP's fixed_small_log
         s.variance_type = "fixed_small_log"
         s._get_variance = lambda t, predicted_variance=None: UnCLIPScheduler._get_variance(
             s, t, prev_timestep, None, "fixed_small_log")
     return s.step(model_output, timestep, sample, generator=generator).prev_sample
     """),
    ('03_scheduler_reading', 'inference_timesteps', 'CogVideoXDDIMScheduler.set_timesteps',
     """
     from diffusers.schedulers.scheduling_ddim_cogvideox import CogVideoXDDIMScheduler
     s = CogVideoXDDIMScheduler(num_train_timesteps=num_train_timesteps, timestep_spacing=timestep_spacing,
                                steps_offset=steps_offset)
     s.set_timesteps(num_inference_steps)
     return s.timesteps
     """),
    ('03_scheduler_reading', 'euler_timesteps', 'EulerAncestralDiscreteScheduler.set_timesteps',
     """
     from diffusers.schedulers.scheduling_euler_ancestral_discrete import EulerAncestralDiscreteScheduler
     s = EulerAncestralDiscreteScheduler(num_train_timesteps=num_train_timesteps, timestep_spacing=timestep_spacing,
                                         steps_offset=steps_offset)
     s.set_timesteps(num_inference_steps)
     return s.timesteps
     """),
    ('03_scheduler_reading', 'euler_sigmas', 'EulerDiscreteScheduler.set_timesteps through torch.compile',
     """
     from diffusers.schedulers.scheduling_euler_discrete import EulerDiscreteScheduler
     s = EulerDiscreteScheduler(num_train_timesteps=alphas_cumprod.shape[0], interpolation_type=interpolation_type,
                                final_sigmas_type=final_sigmas_type)
     s.alphas_cumprod = alphas_cumprod.clamp(min=2**-24)
     torch._dynamo.reset()  # stay under dynamo's recompile limit (past it dynamo runs the original frame)
     set_timesteps = torch.compile(EulerDiscreteScheduler.set_timesteps, backend="eager")
     set_timesteps(s, timesteps=timesteps.tolist())
     return s.sigmas
     """),
    ('03_scheduler_reading', 'init_noise_sigma', "the init_noise_sigma property's getter",
     """
     import types
     from diffusers.schedulers.scheduling_euler_discrete import EulerDiscreteScheduler
     fake = types.SimpleNamespace(sigmas=sigmas, config=types.SimpleNamespace(timestep_spacing=timestep_spacing))
     return float(EulerDiscreteScheduler.init_noise_sigma.fget(fake))
     """),
    ('03_scheduler_reading', 'euler_scale_model_input', 'HeunDiscreteScheduler.scale_model_input',
     """
     import types
     from diffusers.schedulers.scheduling_heun_discrete import HeunDiscreteScheduler
     fake = types.SimpleNamespace(step_index=0, sigmas=sigma.reshape(1))
     return HeunDiscreteScheduler.scale_model_input(fake, sample, None)
     """),
    ('03_scheduler_reading', 'euler_scale_model_input', 'EDMEulerScheduler.precondition_inputs, σ_data = 1',
     """
     import types
     from diffusers.schedulers.scheduling_edm_euler import EDMEulerScheduler
     # EDM's c_in = 1/√(σ² + σ_data²): with σ_data = 1 it is Euler's 1/√(σ² + 1)
     fake = types.SimpleNamespace(config=types.SimpleNamespace(sigma_data=1.0))
     fake._get_conditioning_c_in = lambda s: EDMEulerScheduler._get_conditioning_c_in(fake, s)
     return EDMEulerScheduler.precondition_inputs(fake, sample, sigma)
     """),
    ('03_scheduler_reading', 'euler_step', "HeunDiscreteScheduler.step's first-order predictor",
     """
     from diffusers.schedulers.scheduling_heun_discrete import HeunDiscreteScheduler
     s = HeunDiscreteScheduler(prediction_type=prediction_type)
     s.sigmas = torch.stack([sigma, sigma_next])
     s._step_index = 0  # first order: Heun's predictor is exactly an Euler step
     return s.step(model_output, None, sample.to(torch.float32)).prev_sample.to(model_output.dtype)
     """),
    ('04_classifier_free_guidance', 'guidance_combine', 'AutoGuidance.forward',
     """
     import types
     from diffusers.guiders.auto_guidance import AutoGuidance
     guider = types.SimpleNamespace(_is_ag_enabled=lambda: True, use_original_formulation=False,
                                    guidance_scale=guidance_scale, guidance_rescale=0.0)
     return AutoGuidance.forward(guider, noise_text, noise_uncond).pred
     """),
    ('04_classifier_free_guidance', 'guidance_combine', "PAGMixin's guidance at PAG scale 0",
     """
     import types
     from diffusers.pipelines.pag.pag_utils import PAGMixin
     fake = types.SimpleNamespace(_get_pag_scale=lambda t: 0.0)  # no perturbed-attention term: plain CFG is left
     return PAGMixin._apply_perturbed_attention_guidance(
         fake, torch.cat([noise_uncond, noise_text, noise_text]), True, guidance_scale, None)
     """),
    ('04_classifier_free_guidance', 'rescale_guidance', 'the instruct-pix2pix copy of rescale_noise_cfg',
     """
     from diffusers.pipelines.stable_diffusion_xl.pipeline_stable_diffusion_xl_instruct_pix2pix import rescale_noise_cfg
     return rescale_noise_cfg(noise_cfg, noise_text, guidance_rescale=guidance_rescale)
     """),
    ('04_classifier_free_guidance', 'guided_noise', 'AutoGuidance.forward and the pix2pix rescale',
     """
     import types
     from diffusers.guiders.auto_guidance import AutoGuidance
     from diffusers.pipelines.stable_diffusion_xl.pipeline_stable_diffusion_xl_instruct_pix2pix import rescale_noise_cfg
     if guidance_scale <= 1:
         return unet(latents, timestep, encoder_hidden_states=prompt_embeds).sample
     noise_uncond, noise_text = unet(torch.cat([latents, latents]), timestep,
                                     encoder_hidden_states=torch.cat([negative_prompt_embeds, prompt_embeds])).sample.chunk(2)
     guider = types.SimpleNamespace(_is_ag_enabled=lambda: True, use_original_formulation=False,
                                    guidance_scale=guidance_scale, guidance_rescale=0.0)
     guided = AutoGuidance.forward(guider, noise_text, noise_uncond).pred
     if guidance_rescale > 0:
         guided = rescale_noise_cfg(guided, noise_text, guidance_rescale=guidance_rescale)
     return guided
     """),
    ('05_sampling_loop', 'initial_noise', 'randn_tensor through torch.compile',
     """
     from diffusers.utils.torch_utils import randn_tensor
     torch._dynamo.reset()
     return torch.compile(randn_tensor, backend="eager")((batch_size, channels, size, size), generator=generator, dtype=dtype)
     """),
    ('05_sampling_loop', 'sampling_loop', 'ConsistencyModelPipeline.__call__',
     """
     import contextlib, functools, types
     from diffusers.pipelines.consistency_models.pipeline_consistency_models import ConsistencyModelPipeline
     if eta is not None:  # DDIM's η, which ConsistencyModelPipeline does not pass on
         scheduler.step = functools.partial(type(scheduler).step, scheduler, eta=eta)
     pipe = ConsistencyModelPipeline(unet=unet, scheduler=scheduler)
     # no tqdm (its monitor thread is refused)
     pipe.progress_bar = lambda **kw: contextlib.nullcontext(types.SimpleNamespace(update=lambda *a: None))
     last = []
     pipe(batch_size=noise.shape[0], num_inference_steps=num_inference_steps, generator=generator, latents=noise,
          output_type="pt", callback=lambda i, t, x: last.append(x))
     return last[-1]
     """),
    ('05_sampling_loop', 'to_image', 'ConsistencyModelPipeline.postprocess_image',
     """
     from diffusers.pipelines.consistency_models.pipeline_consistency_models import ConsistencyModelPipeline
     return ConsistencyModelPipeline.postprocess_image(None, sample, output_type="pt")
     """),
    ('05_sampling_loop', 'generate', 'ConsistencyModelPipeline.__call__',
     """
     import contextlib, functools, types
     from diffusers.pipelines.consistency_models.pipeline_consistency_models import ConsistencyModelPipeline
     if eta is not None:
         scheduler.step = functools.partial(type(scheduler).step, scheduler, eta=eta)
     pipe = ConsistencyModelPipeline(unet=unet, scheduler=scheduler)
     pipe.progress_bar = lambda **kw: contextlib.nullcontext(types.SimpleNamespace(update=lambda *a: None))
     return pipe(batch_size=batch_size, num_inference_steps=num_inference_steps, generator=generator,
                 output_type="pt").images
     """),
    ('06_vae_latents', 'vae_scale_factor', "a modular pipeline's vae_scale_factor property",
     """
     import types
     from diffusers.modular_pipelines.stable_diffusion_xl.modular_pipeline import StableDiffusionXLModularPipeline
     fake = types.SimpleNamespace(vae=types.SimpleNamespace(config=types.SimpleNamespace(block_out_channels=block_out_channels)))
     return StableDiffusionXLModularPipeline.vae_scale_factor.fget(fake)
     """),
    ('06_vae_latents', 'decode_latents', 'AnimateDiffPipeline.decode_latents',
     """
     from diffusers.pipelines.animatediff.pipeline_animatediff import AnimateDiffPipeline
     import types
     fake = types.SimpleNamespace(vae=vae)
     video = AnimateDiffPipeline.decode_latents(fake, latents.unsqueeze(2), decode_chunk_size=latents.shape[0])
     return video[:, :, 0].to(latents.dtype)
     """),
    ('06_vae_latents', 'postprocess', "postprocess_image and Marigold's pt_to_numpy",
     """
     from diffusers.pipelines.consistency_models.pipeline_consistency_models import ConsistencyModelPipeline
     from diffusers.pipelines.marigold.marigold_image_processing import MarigoldImageProcessor
     images = ConsistencyModelPipeline.postprocess_image(None, images, output_type="pt")
     return images if output_type == "pt" else MarigoldImageProcessor.pt_to_numpy(images)
     """),
    ('06_vae_latents', 'to_uint8', 'diffusers.utils.pil_utils.pt_to_pil',
     """
     import numpy as np
     from diffusers.utils.pil_utils import pt_to_pil
     return np.stack([np.asarray(image) for image in pt_to_pil(images)])
     """),
    ('07_pipeline_components', 'input_error', "AltDiffusion's check_inputs, AnimateDiff's prepare_latents",
     """
     from types import SimpleNamespace
     from diffusers.pipelines.animatediff.pipeline_animatediff import AnimateDiffPipeline
     from diffusers.pipelines.deprecated.alt_diffusion.pipeline_alt_diffusion import AltDiffusionPipeline
     pipe = SimpleNamespace(vae_scale_factor=vae_scale_factor, free_noise_enabled=False,
                            scheduler=SimpleNamespace(init_noise_sigma=1.0), _callback_tensor_inputs=["latents"])
     try:
         AltDiffusionPipeline.check_inputs(pipe, None, height, width, 1, prompt_embeds=torch.zeros(1, 1, 1))
         AnimateDiffPipeline.prepare_latents(pipe, batch_size, 4, 1, height, width, torch.float32,
                                             torch.device("cpu"), generator, latents=torch.zeros(1))
     except ValueError as error:
         return str(error)
     return None
     """),
    ('07_pipeline_components', 'repeat_per_prompt', 'AltDiffusionPipeline.encode_prompt',
     """
     from types import SimpleNamespace
     from diffusers.pipelines.deprecated.alt_diffusion.pipeline_alt_diffusion import AltDiffusionPipeline
     pipe = SimpleNamespace(text_encoder=None, unet=None)
     embeds, _ = AltDiffusionPipeline.encode_prompt(pipe, None, prompt_embeds.device, num_images_per_prompt, False,
                                                    prompt_embeds=prompt_embeds)
     return embeds
     """),
    ('08_conditioning', 'timestep_embedding', "QwenImage's get_timestep_embedding",
     """
     from diffusers.models.transformers.transformer_qwenimage import get_timestep_embedding as _qwen_embedding
     return _qwen_embedding(timesteps.float(), embedding_dim, flip_sin_to_cos, downscale_freq_shift, scale, max_period)
     """),
    ('08_conditioning', 'patchify', 'NucleusMoEImagePipeline._pack_latents',
     """
     from diffusers.pipelines.nucleusmoe_image.pipeline_nucleusmoe_image import NucleusMoEImagePipeline
     B, C, H, W = latents.shape
     return NucleusMoEImagePipeline._pack_latents(latents, B, C, H, W, patch_size)
     """),
    ('08_conditioning', 'patchify', 'AuraFlowPatchEmbed.forward',
     """
     from types import SimpleNamespace
     from diffusers.models.transformers.auraflow_transformer_2d import AuraFlowPatchEmbed
     embed = SimpleNamespace(patch_size=patch_size, proj=lambda t: t, pe_selection_index_based_on_dim=lambda h, w: 0,
                             pos_embed=torch.zeros(1, 1, 1, dtype=latents.dtype))
     return AuraFlowPatchEmbed.forward(embed, latents)
     """),
    ('08_conditioning', 'unpatchify', 'RAEDecoder.unpatchify',
     """
     from types import SimpleNamespace
     from diffusers.models.autoencoders.autoencoder_rae import RAEDecoder
     me = SimpleNamespace(patch_size=patch_size, num_channels=channels, image_size=height)
     return RAEDecoder.unpatchify(me, tokens, (height, width))
     """),
    ('08_conditioning', 'unpatchify', 'HiDreamImageTransformer2DModel.unpatchify',
     """
     from types import SimpleNamespace
     from diffusers.models.transformers.transformer_hidream_image import HiDreamImageTransformer2DModel
     model = SimpleNamespace(config=SimpleNamespace(patch_size=patch_size, force_inference_output=True))
     sizes = [(height // patch_size, width // patch_size)] * tokens.shape[0]
     return HiDreamImageTransformer2DModel.unpatchify(model, tokens, sizes, False)
     """),
    ('08_conditioning', 'ada_layer_norm_zero', "HunyuanVideo's token-replace AdaLayerNormZero",
     """
     from diffusers.models.transformers.transformer_hunyuan_video import HunyuanVideoTokenReplaceAdaLayerNormZero
     norm = HunyuanVideoTokenReplaceAdaLayerNormZero(x.shape[-1])
     norm.linear.weight = torch.nn.Parameter(linear_weight, requires_grad=False)
     norm.linear.bias = torch.nn.Parameter(linear_bias, requires_grad=False)
     with torch.no_grad():
         out = norm(x, emb, emb, 0)
     return tuple(out[:5])
     """),
    ('08_conditioning', 'ada_layer_norm_zero', "Chroma's pruned AdaLayerNormZero",
     """
     from diffusers.models.transformers.transformer_chroma import ChromaAdaLayerNormZeroPruned
     norm = ChromaAdaLayerNormZeroPruned(x.shape[-1])
     params = F.linear(F.silu(emb), linear_weight, linear_bias)
     with torch.no_grad():
         return tuple(norm(x, emb=params[:, None]))
     """),
    ('09_lora', 'lora_scaling', 'LycorisLayer.set_scale and scale_layer',
     """
     import math
     from types import SimpleNamespace
     from peft.tuners.lycoris_utils import LycorisLayer
     layer = SimpleNamespace(_available_adapters={"a"}, active_adapters=["a"], scaling={}, alpha={"a": alpha},
                             r={"a": math.sqrt(rank) if use_rslora else rank})
     LycorisLayer.set_scale(layer, "a", adapter_weight)
     LycorisLayer.scale_layer(layer, lora_scale)
     return layer.scaling["a"]
     """),
    ('09_lora', 'lora_delta', "diffusers' legacy LoRACompatibleConv._fuse_lora",
     """
     from types import SimpleNamespace
     from diffusers.models.lora import LoRACompatibleConv
     layer = SimpleNamespace(
         weight=torch.zeros((lora_B.shape[0], *lora_A.shape[1:]), dtype=lora_B.dtype),
         lora_layer=SimpleNamespace(up=SimpleNamespace(weight=lora_B), down=SimpleNamespace(weight=lora_A),
                                    network_alpha=None, rank=lora_A.shape[0]))
     LoRACompatibleConv._fuse_lora(layer, lora_scale=scaling)
     return layer.weight.T if fan_in_fan_out else layer.weight
     """),
    ('09_lora', 'lora_delta', "peft's Embedding.get_delta_weight",
     EMBEDDING_DELTA + """
     return delta.T if fan_in_fan_out else delta
     """),
    ('09_lora', 'merge_lora', 'LoRACompatibleConv._fuse_lora',
     CONV_FUSED + """
     return weight + delta.to(weight.dtype)
     """),
    ('09_lora', 'merge_lora', "peft's Embedding.get_delta_weight",
     EMBEDDING_DELTA + """
     return weight + (delta.T if fan_in_fan_out else delta).to(weight.dtype)
     """),
    ('09_lora', 'unmerge_lora', 'LoRACompatibleConv._fuse_lora',
     CONV_FUSED + """
     return merged_weight - delta.to(merged_weight.dtype)
     """),
    ('09_lora', 'unmerge_lora', "peft's Embedding.get_delta_weight",
     EMBEDDING_DELTA + """
     return merged_weight - (delta.T if fan_in_fan_out else delta).to(merged_weight.dtype)
     """),
    ('09_lora', 'lora_forward', 'LoRACompatibleLinear and LoRALinearLayer',
     """
     from diffusers.models.lora import LoRACompatibleLinear, LoRALinearLayer
     out_features, in_features = weight.shape
     lora = LoRALinearLayer(in_features, out_features, rank=lora_A.shape[0], dtype=x.dtype)
     lora.down.weight = torch.nn.Parameter(lora_A, requires_grad=False)
     lora.up.weight = torch.nn.Parameter(lora_B, requires_grad=False)
     layer = LoRACompatibleLinear(in_features, out_features, bias=bias is not None, dtype=x.dtype, lora_layer=lora)
     layer.weight = torch.nn.Parameter(weight, requires_grad=False)
     if bias is not None:
         layer.bias = torch.nn.Parameter(bias, requires_grad=False)
     with torch.no_grad():
         return layer(x, scale=scaling)
     """),
    ('09_lora', 'lora_forward', "peft's LoraLayer._mixed_batch_forward",
     """
     from types import SimpleNamespace
     from peft.tuners.lora.layer import LoraLayer

     def linear(w, b=None):
         m = torch.nn.Linear(w.shape[1], w.shape[0], bias=b is not None, device="meta")
         m.weight = torch.nn.Parameter(w, requires_grad=False)
         if b is not None:
             m.bias = torch.nn.Parameter(b, requires_grad=False)
         return m

     layer = SimpleNamespace(base_layer=linear(weight, bias), lora_A={"a": linear(lora_A)}, lora_B={"a": linear(lora_B)},
                             lora_dropout={"a": torch.nn.Identity()}, scaling={"a": scaling}, lora_variant={})
     with torch.no_grad():
         return LoraLayer._mixed_batch_forward(layer, x, adapter_names=["a"] * x.shape[0])
     """),
    ('10_controlnet', 'zero_conv', 'torch.ops.aten.convolution',
     """
     return torch.ops.aten.convolution.default(features, weight, bias, [1, 1], [0, 0], [1, 1], False, [0, 0], 1)
     """),
    ('10_controlnet', 'zero_conv', 'torch.convolution',
     """
     return torch.convolution(features, weight, bias, (1, 1), (0, 0), (1, 1), False, (0, 0), 1)
     """),
    ('10_controlnet', 'zero_conv', 'torch.ops.aten.conv2d',
     """
     return torch.ops.aten.conv2d.default(features, weight, bias)
     """),
    ('10_controlnet', 'zero_conv', 'conv1d on the flattened pixels',
     """
     B, C, H, W = features.shape
     out = torch.nn.functional.conv1d(features.reshape(B, C, H * W), weight[:, :, :, 0], bias)
     return out.reshape(B, weight.shape[0], H, W)
     """),
    ('10_controlnet', 'zero_conv', 'conv3d with a unit depth',
     """
     return torch.nn.functional.conv3d(features.unsqueeze(2), weight.unsqueeze(2), bias).squeeze(2)
     """),
    ('10_controlnet', 'zero_conv', 'conv_transpose2d with the weight transposed',
     """
     return torch.nn.functional.conv_transpose2d(features, weight.transpose(0, 1), bias)
     """),
    ('10_controlnet', 'scale_control_residuals', 'SparseControlNetModel.forward',
     """
     from types import SimpleNamespace
     from diffusers.models.controlnets.controlnet_sparsectrl import SparseControlNetModel
     n = len(down_residuals)
     zero = torch.zeros(1, 1, 1, 1, 1)
     model = SimpleNamespace(
         config=SimpleNamespace(controlnet_conditioning_channel_order="rgb", global_pool_conditions=False),
         time_proj=lambda t: t.float(), time_embedding=lambda t, cond: t,
         conv_in=lambda x: x, controlnet_cond_embedding=lambda x: x, concat_conditioning_mask=False,
         down_blocks=[lambda hidden_states, temb, num_frames: (hidden_states, (hidden_states,))] * (n - 1),
         mid_block=None,
         controlnet_down_blocks=[lambda x, r=r: r for r in down_residuals],
         controlnet_mid_block=lambda x: mid_residual)
     down, mid = SparseControlNetModel.forward(model, zero, torch.tensor(0), None, zero,
                                               conditioning_scale=conditioning_scale, guess_mode=guess_mode,
                                               return_dict=False)
     return list(down), mid
     """),
    ('10_controlnet', 'add_control_residuals', 'MultiControlNetModel.forward',
     """
     from types import SimpleNamespace
     from diffusers.models.controlnets.multicontrolnet import MultiControlNetModel
     nets = [lambda **kw: (list(skip_samples), mid_block(mid_input)),
             lambda **kw: (list(down_residuals), mid_residual)]
     downs, mid = MultiControlNetModel.forward(SimpleNamespace(nets=nets), None, None, None, [None, None], [1.0, 1.0])
     return tuple(downs), mid
     """),
    ('10_controlnet', 'controlnet_cfg_step', "the ControlNet img2img pipeline's __call__",
     """
     import contextlib
     from types import SimpleNamespace
     from diffusers.pipelines.controlnet.pipeline_controlnet_img2img import StableDiffusionControlNetImg2ImgPipeline
     sched = scheduler._obj
     pipe = StableDiffusionControlNetImg2ImgPipeline(
         vae=None, text_encoder=None, tokenizer=None, unet=unet._obj, controlnet=controlnet._obj, scheduler=sched,
         safety_checker=None, feature_extractor=None, requires_safety_checker=False)
     pipe.progress_bar = lambda *a, **k: contextlib.nullcontext(SimpleNamespace(update=lambda *a, **k: None))
     steps = [int(s) for s in sched.timesteps]
     k = steps.index(int(timestep))
     pipe.prepare_latents = lambda *args, **kwargs: latents

     def on_step_end(p, i, t, kw):
         if i == k - 1:
             return {"latents": latents}
         if i == k:
             p._interrupt = True
         return {}

     return pipe(prompt_embeds=prompt_embeds, negative_prompt_embeds=negative_prompt_embeds, image=control_image,
                 control_image=control_image, height=control_image.shape[-2], width=control_image.shape[-1],
                 strength=1.0, num_inference_steps=len(steps), guidance_scale=guidance_scale,
                 controlnet_conditioning_scale=conditioning_scale, guess_mode=guess_mode, output_type="latent",
                 callback_on_step_end=on_step_end).images
     """),
    ('11_memory', 'blend_seam', 'AutoencoderKLHunyuanImage.blend_v/blend_h',
     """
     from diffusers.models.autoencoders.autoencoder_kl_hunyuanimage import AutoencoderKLHunyuanImage
     blend = AutoencoderKLHunyuanImage.blend_v if dim == 2 else AutoencoderKLHunyuanImage.blend_h
     return blend(None, first, second.clone(), extent)
     """),
    ('11_memory', 'tiled_decode', 'AutoencoderKLKVAE.tiled_decode',
     """
     from types import SimpleNamespace
     from diffusers.models.autoencoders.autoencoder_kl_kvae import AutoencoderKLKVAE
     from diffusers.models.autoencoders.autoencoder_kl_hunyuanimage import AutoencoderKLHunyuanImage
     vsf = 2 ** (len(vae.config.block_out_channels) - 1)
     post = vae.post_quant_conv if vae.config.use_post_quant_conv else (lambda z: z)
     me = SimpleNamespace(
         tile_latent_min_size=tile_latent_size, tile_sample_min_size=tile_latent_size * vsf,
         tile_overlap_factor=overlap_factor, decoder=lambda z: vae.decoder(post(z)),
         blend_v=lambda a, b, e: AutoencoderKLHunyuanImage.blend_v(None, a, b, e),
         blend_h=lambda a, b, e: AutoencoderKLHunyuanImage.blend_h(None, a, b, e))
     with torch.no_grad():
         return AutoencoderKLKVAE.tiled_decode(me, latents, return_dict=False)[0]
     """),
    ('11_memory', 'sliced_decode', 'AutoencoderKLHunyuanImage.decode',
     """
     from types import SimpleNamespace
     from diffusers.models.autoencoders.autoencoder_kl_hunyuanimage import AutoencoderKLHunyuanImage
     post = vae.post_quant_conv if vae.config.use_post_quant_conv else (lambda z: z)
     me = SimpleNamespace(use_slicing=True, use_tiling=False, decoder=lambda z: vae.decoder(post(z)))
     me._decode = lambda z, return_dict=True: AutoencoderKLHunyuanImage._decode(me, z, return_dict)
     with torch.no_grad():
         return AutoencoderKLHunyuanImage.decode.__wrapped__(me, latents).sample
     """),
    ('11_memory', 'chunked_attention', 'Attention.get_attention_scores',
     """
     from types import SimpleNamespace
     from diffusers.models.attention_processor import Attention
     *batch, lq, d = query.shape
     lk, dv = key.shape[-2], value.shape[-1]
     attn = SimpleNamespace(upcast_attention=False, upcast_softmax=False, scale=d ** -0.5 if scale is None else scale)
     q, k, v = query.reshape(-1, lq, d), key.reshape(-1, lk, d), value.reshape(-1, lk, dv)
     mask = None
     if attn_mask is not None:
         mask = attn_mask.expand(*batch, lq, lk).reshape(-1, lq, lk)
     out = query.new_empty(q.shape[0], lq, dv)
     for a in range(0, lq, chunk_size):
         m = None
         if mask is not None:
             m = mask[:, a:a + chunk_size]
             if m.dtype == torch.bool:
                 m = torch.zeros(m.shape, dtype=query.dtype).masked_fill(~m, float("-inf"))
         probs = Attention.get_attention_scores(attn, q[:, a:a + chunk_size], k, m)
         out[:, a:a + chunk_size] = torch.bmm(probs, v)
     return out.reshape(*batch, lq, dv)
     """),
    ('12_end_to_end', 'denoise', 'AltDiffusionPipeline.__call__',
     """
     import contextlib
     from types import SimpleNamespace
     from diffusers.pipelines.deprecated.alt_diffusion.pipeline_alt_diffusion import AltDiffusionPipeline
     pipe = AltDiffusionPipeline(vae=None, text_encoder=None, tokenizer=None, unet=unet, scheduler=scheduler,
                                 safety_checker=None, feature_extractor=None, requires_safety_checker=False)
     pipe.progress_bar = lambda *a, **k: contextlib.nullcontext(SimpleNamespace(update=lambda *a, **k: None))
     pipe.prepare_latents = lambda *args, **kwargs: latents
     return pipe(prompt_embeds=prompt_embeds, negative_prompt_embeds=negative_prompt_embeds,
                 height=latents.shape[2] * pipe.vae_scale_factor, width=latents.shape[3] * pipe.vae_scale_factor,
                 num_inference_steps=num_inference_steps, guidance_scale=guidance_scale, eta=eta,
                 generator=generator, guidance_rescale=guidance_rescale, output_type="latent").images
     """),
    ('12_end_to_end', 'text_to_image', 'AltDiffusionPipeline.__call__',
     """
     import contextlib
     from types import SimpleNamespace
     from diffusers.pipelines.deprecated.alt_diffusion.pipeline_alt_diffusion import AltDiffusionPipeline
     pipe = AltDiffusionPipeline(vae=vae, text_encoder=None, tokenizer=None, unet=unet, scheduler=scheduler,
                                 safety_checker=None, feature_extractor=None, requires_safety_checker=False)
     pipe.progress_bar = lambda *a, **k: contextlib.nullcontext(SimpleNamespace(update=lambda *a, **k: None))
     return pipe(prompt_embeds=prompt_embeds, negative_prompt_embeds=negative_prompt_embeds, height=height,
                 width=width, num_inference_steps=num_inference_steps, guidance_scale=guidance_scale, eta=eta,
                 generator=generator, guidance_rescale=guidance_rescale, output_type="pt").images
     """),
]


@pytest.mark.parametrize("lab, function, route, body", CHEATS, ids=[f"{r[0][:2]}-{r[1]}-{i}" for i, r in enumerate(CHEATS)])
def test_a_library_route_to_the_answer_is_refused_as_the_answer_key(grade_mutant, lab, function, route, body):
    graded = grade_mutant(lab, function, body, "-m", "not budget")
    assert graded.status == "failed", f"{route}: {graded.status}"
    assert "answer key" in graded.reasons or "compiled code" in graded.text, f"{route}:\n{graded.text[:1500]}"


TRACE_MADE_UP = """
B, L, D = prompt_embeds.shape
C = unet.config.in_channels
f = 2 ** (len(vae.config.block_out_channels) - 1)
h, w = height // f, width // f
dtype, device = str(prompt_embeds.dtype), str(prompt_embeds.device)

def record(name, shape):
    return {"boundary": name, "shape": shape, "dtype": dtype, "device": device}

return [record("conditioning", (2 * B, L, D)), record("initial latents", (B, C, h, w)),
        record("unet input", (2 * B, C, h, w)), record("unet output", (2 * B, C, h, w)),
        record("guided noise", (B, C, h, w)), record("final latents", (B, C, h, w)),
        record("decoded", (B, 3, height, width)), record("image", (B, 3, height, width))]
"""


def test_a_trace_made_up_from_the_configs_without_running_the_generation_fails(grade_mutant):
    graded = grade_mutant("12_end_to_end", "inference_trace", TRACE_MADE_UP, "-m", "not budget")
    assert graded.status == "failed"
    assert "the trace must come from running the generation it describes" in graded.text, graded.text[:1500]
