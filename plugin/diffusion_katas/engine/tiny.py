"""Tiny random-weight diffusers models built from configs: offline, deterministic, fast on a CPU.

Graders build their references from these. Weights come from the global RNG, which the plugin seeds
before every check, so a seed reproduces the models too. Each builder imports its diffusers class
by submodule path, only when called: lab 01 never pays for the model imports.
"""
from __future__ import annotations

import functools

# SD-like latent layout, scaled down: 4 latent channels, cross-attention over 32-wide text embeddings.
LATENT_CHANNELS = 4
TEXT_DIM = 32
TEXT_TOKENS = 7
# The tiny CLIP text stack's context length (SD's is 77).
CLIP_MAX_LENGTH = 32


def unet2d(sample_size: int = 16, channels: int = 3):
    """A pixel-space UNet2DModel for DDPM/DDIM pipelines: one resolution, no middle block (8k params, ~1.5 ms a
    forward; two resolutions with attention cost 7 ms, and lab 05 runs ~130 forwards a grading). Still a function
    of both the sample and the timestep (every resnet takes the time embedding), which is all a loop's checks need."""
    from diffusers.models.unets.unet_2d import UNet2DModel

    return UNet2DModel(
        sample_size=sample_size, in_channels=channels, out_channels=channels, layers_per_block=1,
        block_out_channels=(8,), norm_num_groups=4, down_block_types=("DownBlock2D",),
        up_block_types=("UpBlock2D",), mid_block_type=None,
    ).eval()


def unet_cond(sample_size: int = 8, in_channels: int = LATENT_CHANNELS):
    """A text-conditioned UNet2DConditionModel in SD's latent layout (cross-attention dim 32); in_channels 9 is
    SD-inpainting's (the latents, the mask and the masked image's latents stacked)."""
    from diffusers.models.unets.unet_2d_condition import UNet2DConditionModel

    return UNet2DConditionModel(
        sample_size=sample_size, in_channels=in_channels, out_channels=LATENT_CHANNELS,
        layers_per_block=1, block_out_channels=(8, 16), norm_num_groups=4,
        down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
        cross_attention_dim=TEXT_DIM, attention_head_dim=4,
    ).eval()


def vae(downsample: int = 2, sample_size: int = 32, **config):
    """An AutoencoderKL with 4 latent channels; `downsample` 2 (two blocks), 4 (three) or 8 (four, SD-like);
    `config`: more of its config (scaling_factor, shift_factor: SD3's VAE has both)."""
    from diffusers.models.autoencoders.autoencoder_kl import AutoencoderKL

    blocks = {2: (8, 16), 4: (8, 8, 16), 8: (8, 8, 16, 16)}[downsample]
    return AutoencoderKL(
        in_channels=3, out_channels=3, latent_channels=LATENT_CHANNELS, block_out_channels=blocks,
        down_block_types=("DownEncoderBlock2D",) * len(blocks),
        up_block_types=("UpDecoderBlock2D",) * len(blocks),
        layers_per_block=1, norm_num_groups=4, sample_size=sample_size, **config,
    ).eval()


def sd_pipeline(scheduler, unet=None, vae_model=None):
    """A StableDiffusionPipeline with no text encoder: call it with prompt_embeds and
    negative_prompt_embeds. Note: its __init__ rewrites the scheduler's config (steps_offset=1,
    clip_sample=False); build reference loops from pipe.scheduler."""
    import warnings

    from diffusers.pipelines.stable_diffusion.pipeline_stable_diffusion import StableDiffusionPipeline

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        pipe = StableDiffusionPipeline(
            vae=vae_model if vae_model is not None else vae(), text_encoder=None, tokenizer=None,
            unet=unet if unet is not None else unet_cond(), scheduler=scheduler, safety_checker=None,
            feature_extractor=None, requires_safety_checker=False)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def text_embeddings(batch: int, generator, tokens: int = TEXT_TOKENS):
    """Random prompt embeddings (B, tokens, 32), standing in for a text encoder's output."""
    import torch

    return torch.randn((batch, tokens, TEXT_DIM), generator=generator)


POOLED_DIM = 16  # the tiny SD3 transformer's pooled text width


def sd3_transformer(sample_size: int = 8):
    """A tiny SD3Transformer2DModel in SD's latent layout: 4 channels, 2×2 patches, one joint block of 2 heads
    of 8, text width 32 (TEXT_DIM), pooled width 16 (POOLED_DIM). Call it with hidden_states, timestep,
    encoder_hidden_states and pooled_projections."""
    from diffusers.models.transformers.transformer_sd3 import SD3Transformer2DModel

    return SD3Transformer2DModel(
        sample_size=sample_size, patch_size=2, in_channels=LATENT_CHANNELS, out_channels=LATENT_CHANNELS,
        num_layers=1, attention_head_dim=8, num_attention_heads=2, joint_attention_dim=TEXT_DIM,
        caption_projection_dim=16, pooled_projection_dim=POOLED_DIM, pos_embed_max_size=sample_size,
    ).eval()


def flux_pipeline(guidance_embeds: bool):
    """A FluxPipeline with no text encoders (call it with prompt_embeds and pooled_prompt_embeds): a tiny
    FluxTransformer2DModel (16 packed latent channels, 2 heads of 8, text width 16, pooled width 8; guidance
    embedded when `guidance_embeds`, as in Flux-dev) and a 2-block VAE (vae_scale_factor 2)."""
    from diffusers.models.transformers.transformer_flux import FluxTransformer2DModel
    from diffusers.pipelines.flux.pipeline_flux import FluxPipeline
    from diffusers.schedulers.scheduling_flow_match_euler_discrete import FlowMatchEulerDiscreteScheduler

    transformer = FluxTransformer2DModel(
        patch_size=1, in_channels=16, num_layers=1, num_single_layers=1, attention_head_dim=8, num_attention_heads=2,
        joint_attention_dim=16, pooled_projection_dim=8, guidance_embeds=guidance_embeds, axes_dims_rope=(2, 2, 4),
    ).eval().requires_grad_(False)
    pipe = FluxPipeline(scheduler=FlowMatchEulerDiscreteScheduler(), vae=vae(2), text_encoder=None, tokenizer=None,
                        text_encoder_2=None, tokenizer_2=None, transformer=transformer)
    pipe.set_progress_bar_config(disable=True)
    return pipe


@functools.cache
def clip_tokenizer():
    """A character-level CLIPTokenizer built offline: byte characters, their word-final forms, BOS, EOS
    (EOS is the highest id and also the padding token, as in SD 1.x)."""
    from transformers import CLIPTokenizer
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    chars = list(bytes_to_unicode().values())
    vocab = {c: i for i, c in enumerate(chars)}
    for c in chars:
        vocab.setdefault(c + "</w>", len(vocab))
    vocab["<|startoftext|>"] = len(vocab)
    vocab["<|endoftext|>"] = len(vocab)
    return CLIPTokenizer(vocab=vocab, merges=[], model_max_length=CLIP_MAX_LENGTH)


def clip_text_encoder(layers: int = 3, eos_token_id: int | None = None):
    """A random CLIPTextModel for clip_tokenizer() (hidden 32, 4 heads, CLIP_MAX_LENGTH positions); eos_token_id
    defaults to the tokenizer's (pass 2 for the pre-2023 configs, whose pooled output takes the argmax id)."""
    from transformers import CLIPTextConfig, CLIPTextModel

    tok = clip_tokenizer()
    config = CLIPTextConfig(vocab_size=len(tok.get_vocab()), hidden_size=TEXT_DIM, intermediate_size=37,
                            num_hidden_layers=layers, num_attention_heads=4, max_position_embeddings=CLIP_MAX_LENGTH,
                            bos_token_id=tok.bos_token_id, pad_token_id=tok.pad_token_id,
                            eos_token_id=tok.eos_token_id if eos_token_id is None else eos_token_id)
    model = CLIPTextModel(config).eval()
    import torch

    with torch.no_grad():  # LayerNorms start as the identity affine map, and LN(LN(x)) = LN(x): give them weights
        for module in model.modules():
            if isinstance(module, torch.nn.LayerNorm):
                module.weight.normal_(1.0, 0.2)
                module.bias.normal_(0.0, 0.2)
    return model
