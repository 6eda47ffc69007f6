"""Every declared parameter of a graded function is exercised: for each check of labs 04-12, the check's
cases give each parameter of the solution function at least two different values (for tensors: two
shapes or dtypes; numbers compared with their type, so 8 and 8.0 differ). A parameter that cannot vary
within a check is listed in FIXED with the reason. An entry for a parameter that does vary fails too,
so the list stays true.

The scenarios are built as the plugin builds them (the same seeding), without running any learner code.
"""
from __future__ import annotations

import inspect
from pathlib import Path

import pytest
import torch

from diffusion_katas.core.course import load_module

REPO = Path(__file__).resolve().parents[2]
LABS = ["01_forward_noise", "02_denoising_step", "03_scheduler_reading", "04_classifier_free_guidance",
        "05_sampling_loop", "06_vae_latents", "07_pipeline_components", "08_conditioning", "09_lora",
        "10_controlnet", "11_memory", "12_end_to_end", "13_flow_matching", "14_multistep_solvers", "15_karras_edm",
        "16_few_step", "17_mmdit_attention", "18_text_and_image_prompts", "19_half_precision",
        "20_first_block_cache", "21_serving_batcher", "22_offload_schedule", "23_training_objective",
        "24_img2img_inpainting", "25_video_latents"]
SEED = 1234

MODEL = "a model built from the lab's one tiny config: its weights are random, what it is never varies"

# (lab, function, check) -> {parameter: why it takes one value in that check}
FIXED: dict[tuple[str, str, str], dict[str, str]] = {}


def fixed(lab: str, function: str, check: str, **reasons: str) -> None:
    FIXED.setdefault((lab, function, check), {}).update(reasons)


GENERATOR = ("a seeded torch.Generator in every case (its seed changes with the case); generator=None and lists "
             "of generators are graded in lab 07's prepare_latents")
SINGLE = "a single-case check by design: it pins one situation (its own check name says which)"
L05, L06, L07, L08, L09, L10, L11, L12 = ("05_sampling_loop", "06_vae_latents", "07_pipeline_components",
                                          "08_conditioning", "09_lora", "10_controlnet", "11_memory",
                                          "12_end_to_end")

# ---- labs 02 and 03 -------------------------------------------------------------------------------------
for _check in ("vs DDIMScheduler.step, every timestep", "vs DDIMScheduler.step, float16"):
    fixed("02_denoising_step", "ddim_step", _check, generator=GENERATOR)
for _check in ("vs DDPMScheduler.step, every timestep", "vs DDPMScheduler.step, float16"):
    fixed("02_denoising_step", "ddpm_step", _check, generator=GENERATOR)
for _check, _kind in (("vs Euler step, epsilon", "epsilon"), ("vs Euler step, v_prediction", "v_prediction"),
                      ("vs Euler step, sample", "sample")):
    fixed("03_scheduler_reading", "euler_step", _check,
          prediction_type=f"one check per prediction type, named for it: this one is {_kind}, the other checks "
                          "take the others")

# ---- lab 23 -------------------------------------------------------------------------------------------
L23 = "23_training_objective"
_DRAWS = ("a torch.Generator seeded per case: every draw of the step comes from it, and where the draws leave it "
          "is checked (Scenario.generators_after)")
fixed(L23, "ddpm_training_loss", "vs train_text_to_image.py's loss (the same draws from the generator)",
      unet=MODEL, generator=_DRAWS)
fixed(L23, "timestep_density", "vs compute_density_for_timestep_sampling (the same generator)", generator=_DRAWS)
fixed(L23, "flow_matching_loss", "vs train_dreambooth_sd3.py's loss (the same draws from the generator)",
      transformer=MODEL, generator=_DRAWS)
L24 = "24_img2img_inpainting"
fixed(L24, "img2img_latents", "vs the img2img pipelines' prepare_latents (the same generator)", generator=_DRAWS)
fixed(L24, "prepare_mask_latents", "vs StableDiffusionInpaintPipeline.prepare_mask_latents", generator=_DRAWS)

# ---- lab 14 -------------------------------------------------------------------------------------------
L14 = "14_multistep_solvers"
_GAUSS = ("the ideal ε-prediction of Gaussian data (μ and s drawn per case from the check's generator): the one "
          "denoiser whose probability-flow ODE is solved by hand; it checks and counts its calls")
fixed(L14, "dpm_solver_sample", "vs DPMSolverMultistepScheduler.step, the whole loop", denoiser=_GAUSS)
fixed(L14, "dpm_solver_sample", "★ convergence order ≈ 2 (halve the step, the error falls 4×)", denoiser=_GAUSS,
      final_sigmas_type="'sigma_min' by design: onto σ = 0 the last step is a jump to x̂_0 whose error is not a "
                        "power of h, so no order could be measured; the loop check varies it")

# ---- lab 15 -------------------------------------------------------------------------------------------
fixed("15_karras_edm", "karras_sigmas", "vs EulerDiscreteScheduler(use_karras_sigmas=True).set_timesteps → sigmas",
      rho="EulerDiscreteScheduler._convert_to_karras hard-codes ρ = 7; the EDMEulerScheduler check varies ρ")
fixed("15_karras_edm", "edm_sample", "vs scale_model_input, the network and EDMEulerScheduler.step, whole runs",
      network="the ideal EDM network of Gaussian data (its per-channel spread drawn per case): the one network "
              "whose inputs it can read back; it checks and counts its calls")

# ---- lab 04 -------------------------------------------------------------------------------------------

# ---- lab 05 -------------------------------------------------------------------------------------------
fixed(L05, "initial_noise", "vs the pipeline's first UNet input", generator=GENERATOR)
fixed(L05, "initial_noise", "vs randn_tensor, more shapes", generator=GENERATOR)
for _check in ("vs DDPMPipeline, pre-clamp sample", "vs DDIMPipeline, η 0/½/1, pre-clamp"):
    fixed(L05, "sampling_loop", _check, unet="the tiny pixel UNet, wrapped to count calls: " + MODEL,
          generator=GENERATOR)
fixed(L05, "sampling_loop", "vs DDPMPipeline, pre-clamp sample",
      eta="DDPM has no η (DDPMScheduler.step takes none): the default is passed; η is varied in the DDIM check")
fixed(L05, "generate", "vs DDPMPipeline images, end to end",
      unet="the tiny pixel UNet, wrapped to count calls: " + MODEL, generator=GENERATOR,
      scheduler="the check is named for its DDPMScheduler; the DDIM check uses the other scheduler",
      batch_size="one end-to-end run (its cost is the whole pipeline); the DDIM check varies the batch",
      num_inference_steps="one end-to-end run; the DDIM check varies the steps, and sampling_loop within its checks",
      eta="DDPM has no η: the default is passed (η is varied by the DDIM checks)")
fixed(L05, "generate", "vs DDIMPipeline images, end to end", generator=GENERATOR)

# ---- lab 06 -------------------------------------------------------------------------------------------
fixed(L06, "encode_latents", "vs _encode_vae_image, sampled", generator=GENERATOR,
      sample_posterior="the check is the sampled branch (True); the mode check is the other branch")
fixed(L06, "encode_latents", "vs retrieve_latents(argmax) · s, the mode",
      sample_posterior="the check is the mode branch (False); the sampled check is the other branch")

# ---- lab 07 -------------------------------------------------------------------------------------------
fixed(L07, "prepare_latents", "vs prepare_latents, one generator",
      generator="the check is the one-generator branch; a list and None have checks of their own",
      latents="no latents given in this check; 'latents given' is its own check")
fixed(L07, "prepare_latents", "vs prepare_latents, a generator per sample",
      latents="no latents given in this check; 'latents given' is its own check")
fixed(L07, "prepare_latents", "vs prepare_latents, generator=None (the global RNG)",
      generator="the check is the generator=None branch (the global RNG, its end state compared too)",
      latents="no latents given in this check; 'latents given' is its own check")

# ---- lab 08 -------------------------------------------------------------------------------------------
for _param in ("flip_sin_to_cos", "downscale_freq_shift", "scale", "max_period"):
    fixed(L08, "timestep_embedding", "vs Timesteps, the UNets' settings", **{
        _param: "this check passes only timesteps and the width: the function's defaults must be the "
                "UNets' settings; 'vs get_timestep_embedding, options' varies every option"})

# ---- lab 09 -------------------------------------------------------------------------------------------
_LINEAR = "nn.Linear and nn.Conv2d weights are (out, in): fan_in_fan_out is False; the Conv1D check sets it True"
_CONV1D = "the check is GPT-2-style Conv1D weights, (in, out): fan_in_fan_out is True throughout"
fixed(L09, "lora_delta", "vs get_delta_weight, Linear and Conv2d", fan_in_fan_out=_LINEAR)
fixed(L09, "lora_delta", "Conv1D weights, fan_in_fan_out", fan_in_fan_out=_CONV1D)
fixed(L09, "merge_lora", "vs fuse_lora, every LoRA layer", fan_in_fan_out=_LINEAR)
fixed(L09, "merge_lora", "two adapters, fused one after the other", fan_in_fan_out=_LINEAR)
fixed(L09, "unmerge_lora", "vs unfuse_lora, every LoRA layer", fan_in_fan_out=_LINEAR)
for _function in ("merge_lora", "unmerge_lora"):
    fixed(L09, _function, "Conv1D weights, fan_in_fan_out", fan_in_fan_out=_CONV1D,
          lora_A="one Conv1D layer: the layout is what the check is about; shapes vary in the other checks",
          scaling="one Conv1D layer with one adapter: scalings vary in the other checks")
fixed(L09, "lora_forward", "vs the same layer after fuse_lora",
      scaling="one adapter per case with one LoraConfig (α/r) and fuse_lora's default scale; lora_scaling "
              "grades every way the scale is made")

# ---- lab 10 -------------------------------------------------------------------------------------------
_HALF = "the float16 check pins the dtype on the tiny layout; shapes vary in the float32 check"
fixed(L10, "scale_control_residuals", "vs ControlNetModel.forward, float16", down_residuals=_HALF,
      mid_residual=_HALF)
fixed(L10, "add_control_residuals", "vs UNet2DConditionModel.forward",
      mid_block="the UNet's own mid block with its arguments bound (what it is follows the layout, "
                "which the skips' shapes show varying)")
for _param in ("skip_samples", "mid_input", "mid_block", "down_residuals", "mid_residual"):
    fixed(L10, "add_control_residuals", "fresh ControlNet: UNet unchanged", **{_param: SINGLE})
fixed(L10, "controlnet_cfg_step", "vs StableDiffusionControlNetPipeline",
      unet="the tiny UNet of the pipeline: " + MODEL, controlnet="ControlNetModel.from_unet of it: " + MODEL)

# ---- lab 11 -------------------------------------------------------------------------------------------

# ---- lab 12 -------------------------------------------------------------------------------------------
fixed(L12, "denoise", "vs StableDiffusionPipeline latents", generator=GENERATOR)
fixed(L12, "text_to_image", "vs StableDiffusionPipeline images", generator=GENERATOR)
fixed(L12, "inference_trace", "vs the pipeline's own boundaries", generator=GENERATOR)

# ---- lab 16 -------------------------------------------------------------------------------------------
L16 = "16_few_step"
for _check in ("vs LCMScheduler.step, every timestep", "vs LCMScheduler.step, float16"):
    fixed(L16, "lcm_step", _check, generator=GENERATOR)
fixed(L16, "few_step_sample", "vs StableDiffusionPipeline(guidance_scale ≤ 1.5), latents", generator=GENERATOR)

# ---- lab 17 -------------------------------------------------------------------------------------------
fixed("17_mmdit_attention", "joint_attention", "vs JointAttnProcessor2_0",
      attn="an Attention module (no diffusers config, so kind() sees only its class): its heads, head_dim, "
           "qk_norm, context_pre_only and dtype do vary by case, as the check's label shows")

# ---- lab 18 -------------------------------------------------------------------------------------------
_IP_SHAPE = ("(no diffusers config, so kind() sees only its class): the heads, head_dim, number of adapters "
             "and dtype do vary by case, as the check's label shows")
fixed("18_text_and_image_prompts", "ip_adapter_attention", "vs IPAdapterAttnProcessor2_0",
      attn="an Attention module " + _IP_SHAPE, to_k_ip="the adapters' key Linears " + _IP_SHAPE,
      to_v_ip="the adapters' value Linears " + _IP_SHAPE)
fixed("20_first_block_cache", "first_block_cache_step",
      "an unchanged call at threshold 0 (δ = 0 is not > 0: diffusers skips)",
      threshold="the check pins the one case where > and ≥ differ: δ = 0 exactly, at threshold 0")
fixed("21_serving_batcher", "serve", "vs each request alone through StableDiffusionPipeline",
      unet="the tiny UNet of the pipeline (a DenoiserProbe around it): " + MODEL)


def kind(value):
    """What a value is, for 'does this parameter vary': tensors by shape and dtype (0-dim by value too),
    numbers by type and value, containers by length and their items' kinds, models by class and config."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return (type(value).__name__, value)
    if isinstance(value, torch.Tensor):
        return ("tensor", tuple(value.shape), str(value.dtype)) + ((value.item(),) if value.ndim == 0 else ())
    if isinstance(value, (torch.dtype, torch.device)):
        return (type(value).__name__, str(value))
    if isinstance(value, torch.Generator):
        return ("generator",)
    if isinstance(value, (list, tuple)):
        return (type(value).__name__, len(value), tuple(kind(v) for v in value))
    if isinstance(value, dict):
        return ("dict", tuple(sorted((k, kind(v)) for k, v in value.items())))
    inner = getattr(value, "_obj", None) or getattr(value, "model", None) or value  # probes and wrappers
    config = getattr(inner, "config", None)
    if config is not None:
        weights = next(inner.parameters(), None) if isinstance(inner, torch.nn.Module) else None
        items = config.to_dict() if hasattr(config, "to_dict") else dict(config)  # transformers' configs too
        return (type(inner).__name__, repr(sorted(items.items(), key=lambda kv: kv[0])),
                None if weights is None else str(weights.dtype))
    return (type(inner).__name__,)


def solution_parameters(lab: str) -> dict[str, list[str]]:
    module = load_module(REPO / "solutions" / f"{lab}.py", f"_params_solution_{lab}")
    return {name: list(inspect.signature(fn).parameters) for name, fn in vars(module).items()
            if inspect.isfunction(fn) and fn.__module__ == module.__name__}


def check_kinds(check) -> list[dict]:
    """The kind of every input of every scenario the check builds (the plugin's seeding)."""
    torch.manual_seed(SEED ^ 0x5EED)
    g = torch.Generator().manual_seed(SEED)
    kinds = []
    for case in check.cases:
        built = check.build(dict(case), g)
        for scenario in [built] if not isinstance(built, (list, tuple)) else built:
            kinds.append({name: kind(value) for name, value in scenario.inputs.items()})
    return kinds


@pytest.mark.parametrize("lab", LABS)
def test_every_parameter_of_every_check_varies_or_says_why_not(graders_loaded, lab):
    grader = load_module(REPO / "graders" / f"{lab}.py", f"_params_grader_{lab}")
    params = solution_parameters(lab)
    katas = [v for v in vars(grader).values() if type(v).__name__ == "Kata"]
    assert katas, f"no Kata in graders/{lab}.py"
    problems = []
    for kata in katas:
        for check in kata.checks:
            if any(getattr(m, "name", "") == "cuda" for m in check.marks):
                continue
            kinds = check_kinds(check)
            reasons = FIXED.get((lab, kata.name, check.name), {})
            for param in params[kata.name]:
                seen = {k.get(param, ("default",)) for k in kinds}
                if len(seen) < 2 and param not in reasons:
                    shown = str(next(iter(seen)))
                    shown = shown if len(shown) < 100 else shown[:100] + "…"
                    problems.append(f"{kata.name} [{check.name}]: `{param}` takes one value in every case "
                                    f"({shown}): add a case that varies it, or list it in FIXED with the reason")
                elif len(seen) >= 2 and param in reasons:
                    problems.append(f"{kata.name} [{check.name}]: `{param}` varies ({len(seen)} values) but FIXED "
                                    "says it cannot: remove the entry")
    assert not problems, "\n".join(problems)


def test_every_fixed_entry_names_a_real_check_and_parameter(graders_loaded):
    for (lab, function, check_name), reasons in FIXED.items():
        grader = load_module(REPO / "graders" / f"{lab}.py", f"_params_grader_{lab}")
        kata = getattr(grader, function)
        assert check_name in [c.name for c in kata.checks], (lab, function, check_name)
        params = solution_parameters(lab)[function]
        assert set(reasons) <= set(params), (lab, function, set(reasons) - set(params))
        assert all(len(r) > 20 for r in reasons.values()), "a reason is a sentence"
