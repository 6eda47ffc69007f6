"""The first-divergence localizer (engine/helpers.first_divergence): when a learner's sampling loop ends
wrong, it names the first step where their trajectory left the pipeline's, and what differed there.

Each planted bug runs a real diffusers scheduler (Euler, DDIM) around a small conditional denoiser, with
classifier-free guidance, against the same loop written right and recorded by PipelineRecorder."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from diffusers import DDIMScheduler, EulerDiscreteScheduler

from diffusion_katas.engine.helpers import PipelineRecorder, TrajectoryProbe, first_divergence


class Denoiser(torch.nn.Module):
    """ε̂(x, t, c): a small conv net whose output depends on the sample, the timestep and the conditioning."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.conv = torch.nn.Conv2d(4, 4, 3, padding=1)

    def forward(self, sample, timestep, encoder_hidden_states=None):
        t = torch.as_tensor(timestep, dtype=sample.dtype).reshape(-1, 1, 1, 1) / 1000
        c = encoder_hidden_states.mean(dim=(1, 2)).reshape(-1, 1, 1, 1)
        return (self.conv(sample) * (1 + t) + c,)


def loop(unet, scheduler, x, cond, uncond, steps=5, scale=6.0, *, bug=None):
    scheduler.set_timesteps(steps)
    for i, t in enumerate(scheduler.timesteps):
        x_in = torch.cat([x, x])
        if bug != "no scale_model_input":
            x_in = scheduler.scale_model_input(x_in, t)
        t_in = t + 7 if bug == "wrong t at step 3" and i == 2 else t
        u, c = unet(x_in, t_in, encoder_hidden_states=torch.cat([uncond, cond]))[0].chunk(2)
        if bug == "guidance after the step":
            x_u = scheduler.step(u, t, x).prev_sample
            if getattr(scheduler, "step_index", None) is not None:  # Euler counts its steps: the same t again
                scheduler._step_index -= 1  # noqa: SLF001
            x_c = scheduler.step(c, t, x).prev_sample
            x = x_u + scale * (x_c - x_u)
        else:
            x = scheduler.step(u + scale * (c - u), t, x).prev_sample
    return x


def run(scheduler_cls, bug):
    torch.manual_seed(1)
    x = torch.randn(2, 4, 6, 6)
    cond, uncond = torch.randn(2, 3, 8), torch.randn(2, 3, 8)
    unet = Denoiser()
    scheduler = scheduler_cls(beta_schedule="scaled_linear", beta_start=0.00085, beta_end=0.012)
    pipe = SimpleNamespace(scheduler=scheduler)
    with torch.no_grad(), PipelineRecorder(pipe, unet) as rec:
        expected = loop(unet, scheduler, x * scheduler.init_noise_sigma, cond, uncond)
    probe = TrajectoryProbe(unet)
    mine_scheduler = scheduler_cls.from_config(scheduler.config)
    with torch.no_grad():
        out = loop(probe, mine_scheduler, x * mine_scheduler.init_noise_sigma, cond, uncond, bug=bug)
    return rec.steps, probe, expected, out


def test_a_correct_loop_has_no_divergence():
    steps, probe, expected, out = run(EulerDiscreteScheduler, None)
    assert torch.allclose(out, expected) and first_divergence(probe, steps) is None


@pytest.mark.parametrize("scheduler_cls", [EulerDiscreteScheduler, DDIMScheduler])
def test_a_wrong_timestep_at_one_step_is_named_at_that_step_as_the_timestep(scheduler_cls):
    steps, probe, expected, out = run(scheduler_cls, "wrong t at step 3")
    found = first_divergence(probe, steps)
    assert found.startswith("step 3 of 5: the denoiser got t = ") and "the timestep itself" in found, found


def test_a_missing_scale_model_input_for_euler_is_named_at_the_first_step_with_its_factor():
    steps, probe, expected, out = run(EulerDiscreteScheduler, "no scale_model_input")
    found = first_divergence(probe, steps)
    sigma = float(EulerDiscreteScheduler(beta_schedule="scaled_linear", beta_start=0.00085,
                                         beta_end=0.012).sigmas.max())
    assert found.startswith("step 1 of 5: the denoiser's input differs"), found
    assert f"{(sigma ** 2 + 1) ** 0.5:.4g}× the pipeline's everywhere" in found and "scale_model_input" in found


def test_guidance_applied_after_the_step_is_named_at_the_update_after_the_first_step():
    # DDIM clips x̂_0 to [-1, 1] (clip_sample=True): the step is not linear in ε̂, so guiding two stepped
    # latents is not stepping the guided ε̂ (for an affine step, such as Euler's, the two are equal).
    steps, probe, expected, out = run(DDIMScheduler, "guidance after the step")
    found = first_divergence(probe, steps)
    assert found.startswith("step 2 of 5: the denoiser's input differs"), found
    assert "the update after step 1" in found and "guidance combine" in found


def test_a_loop_that_stops_early_or_calls_too_often_says_so():
    steps, probe, _, _ = run(EulerDiscreteScheduler, None)
    short = TrajectoryProbe(probe.denoiser)
    short.seen_t, short.seen_inputs, short.seen_outputs = probe.seen_t[:2], probe.seen_inputs[:2], probe.seen_outputs[:2]
    assert first_divergence(short, steps).startswith("step 3 of 5: your loop stopped calling the denoiser after 2")
    long = TrajectoryProbe(probe.denoiser)
    long.seen_t, long.seen_inputs, long.seen_outputs = (probe.seen_t * 2, probe.seen_inputs * 2,
                                                        probe.seen_outputs * 2)
    assert "your loop called it 10 times" in first_divergence(long, steps)
