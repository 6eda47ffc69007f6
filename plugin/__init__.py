"""diffusion katas: a pytest plugin that grades diffusion-inference katas against diffusers."""
