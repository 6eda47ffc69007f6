"""The 2-D toy set of `kata see`: two moons, and the ideal EDM network for them, for samplers at a glance.

The data is a fixed cloud of points drawn here (no download, no training): two interleaved half circles, scaled
to a standard deviation of about σ_data = 0.5. Its ideal denoiser is exact: for a cloud of points x_i,
E[x₀ | x_σ = x] = Σ_i w_i x_i with w = softmax(−‖x − x_i‖² / 2σ²). A sampler that is right carries Gaussian noise
at σ_max onto the moons; one that is wrong lands off them, and a scatter plot shows it at once.

`MoonsEDMNetwork` is that denoiser as the raw EDM network F (D = c_skip·x + c_out·F), reading σ back from
c_noise = ¼·ln σ and x from c_in·x, so it sees only what a real EDM network sees. Points are samples shaped
(B, 2, 1, 1): two channels of a 1×1 image, so a sampler written for images runs on them unchanged.
"""
from __future__ import annotations

SIGMA_DATA = 0.5


def moons(count: int = 96, seed: int = 0):
    """(count, 2) float64 points on two interleaved half circles, centred, scaled to std ≈ SIGMA_DATA per axis."""
    import math

    import torch

    g = torch.Generator().manual_seed(seed)
    half = count // 2
    angle = torch.rand(count, generator=g, dtype=torch.float64) * math.pi
    upper = torch.stack([angle[:half].cos(), angle[:half].sin()], dim=1)
    lower = torch.stack([1 - angle[half:].cos(), 0.5 - angle[half:].sin()], dim=1)
    points = torch.cat([upper, lower]) + 0.04 * torch.randn(count, 2, generator=g, dtype=torch.float64)
    points = points - points.mean(dim=0)
    return points * (SIGMA_DATA / points.std(dim=0))


class MoonsEDMNetwork:
    """The raw EDM network F whose denoiser is ideal for the `moons` cloud (epsilon parametrisation)."""

    def __init__(self, points=None, sigma_data: float = SIGMA_DATA):
        self.points = moons() if points is None else points
        self.sigma_data = sigma_data

    def __repr__(self) -> str:
        return f"MoonsEDMNetwork(ideal F for {len(self.points)} points on two moons)"

    def denoise(self, x, sigma):
        """E[x₀ | x] for x (B, 2) float64 at noise level sigma (a float64 0-dim tensor)."""
        import torch

        d2 = ((x[:, None, :] - self.points[None]) ** 2).sum(-1)  # (B, N)
        weights = torch.softmax(-d2 / (2 * sigma**2), dim=1)
        return weights @ self.points

    def __call__(self, x_in, c_noise, *args, **kwargs):
        import torch

        sigma = torch.exp(4 * torch.as_tensor(c_noise, dtype=torch.float64)).reshape(-1)[0]
        sd2 = self.sigma_data**2
        x = x_in.double().reshape(x_in.shape[0], 2) * (sigma**2 + sd2) ** 0.5
        c_skip = sd2 / (sigma**2 + sd2)
        c_out = sigma * self.sigma_data / (sigma**2 + sd2) ** 0.5
        F = (self.denoise(x, sigma) - c_skip * x) / c_out
        return F.reshape(x_in.shape).to(x_in.dtype)
