"""How near a learner's output is to a trap's (comparison.closeness): the yardstick is the smallest of the distances
to the answer and the trap's own size; an output with the trap's shape, not the answer's, is measured by the trap's
size alone."""
import math

import torch

from diffusion_katas.core.tolerances import TRAP_NEAR
from diffusion_katas.engine.comparison import closeness


def test_an_exact_match_with_the_trap_is_zero():
    trap = torch.randn(3, 4)
    assert closeness(trap.clone(), trap, torch.zeros(3, 4) + 5) == 0.0


def test_a_variant_of_a_wrong_shaped_trap_is_near_by_the_traps_own_size():
    g = torch.Generator().manual_seed(0)
    trap = torch.randn(1, 3, 8, 8, generator=g)  # the mistake's shape (a scale factor of 8 for 4: twice the size)
    answer = torch.randn(1, 3, 4, 4, generator=g)
    variant = trap + 0.02 * torch.randn(trap.shape, generator=g)  # the same mistake, blended a little differently
    assert closeness(variant, trap, answer) <= TRAP_NEAR
    assert closeness(torch.randn(trap.shape, generator=g), trap, answer) > TRAP_NEAR  # another output of that shape


def test_an_output_whose_shape_is_neither_the_traps_nor_the_answers_is_not_near():
    assert math.isinf(closeness(torch.zeros(2, 2), torch.zeros(3, 3), torch.zeros(4, 4)))
