"""Compare a learner's output with the reference's, and say plainly how they differ.

Structure first (type, length, shape, dtype, device, finiteness), each with its own plain message;
then values: the worst element, its index, both values, the tolerance and its reason, and how many
elements are off.

Where the grader also gives the float64 shadow of the reference (`exact`: the same math on the same
inputs in float64), a value also passes when it is no further from exact math than diffusers' own
answer allows (core.tolerances.REFERENCE_ERROR), element by element or over the whole output (its
largest and its RMS error against diffusers'): diffusers' rounding is the measure of what is right, an
answer more accurate than diffusers is never marked wrong, and no element's rounding luck decides. The
message then gives your error vs exact math, diffusers' error vs exact math and the allowances.
"""
from __future__ import annotations

import math
from typing import Any

from diffusion_katas.core.tolerances import REFERENCE_ERROR, ShadowRule, Tol


def _fmt(v: float) -> str:
    return f"{v:.6g}"


def describe(value: Any) -> str:
    """A short description of a value for messages: tensors by shape/dtype, the rest by repr."""
    import torch

    if isinstance(value, torch.Tensor):
        return f"Tensor(shape={tuple(value.shape)}, dtype={value.dtype}, device={value.device})"
    if isinstance(value, (list, tuple)) and value and all(isinstance(v, torch.Tensor) for v in value):
        shapes = ", ".join(str(tuple(v.shape)) for v in value[:4]) + (", …" if len(value) > 4 else "")
        return f"{type(value).__name__} of {len(value)} {value[0].dtype} tensors {shapes}"
    if isinstance(value, (list, tuple)) and len(value) > 6:
        text = repr(value) if _plain(value) else ""
        if text and len(text) <= 240:  # names, counts: short enough to read whole
            return text
        return f"{type(value).__name__} of {len(value)}"
    if isinstance(value, torch.Generator):
        return "torch.Generator"
    if isinstance(value, torch.nn.Module):
        n = sum(p.numel() for p in value.parameters())
        return f"{type(value).__name__}({n:,} parameters)"
    if isinstance(value, (list, tuple, dict)) and not _plain(value.values() if isinstance(value, dict) else value):
        # tensors, models or objects inside: each by its short form, never their repr (a tensor's prints its values:
        # milliseconds each, for a line most checks never show)
        if isinstance(value, dict):
            text = "{" + ", ".join(f"{k!r}: {_short(v)}" for k, v in list(value.items())[:6]) \
                + (", …" if len(value) > 6 else "") + "}"
        else:
            text = ("[%s]" if isinstance(value, list) else "(%s)") % ", ".join(_short(v) for v in value)
        return text if len(text) <= 240 else text[:237] + "..."
    text = repr(value)
    if "\n" in text or (len(text) > 80 and not isinstance(value, (str, list, tuple, dict))):
        return type(value).__name__  # schedulers and other objects with a many-line repr
    limit = 240 if isinstance(value, (list, tuple)) and _plain(value) else 80
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _short(value: Any) -> str:
    """A value inside a container, for `describe`: a tensor as Tensor(shape; dtype), the rest as describe says."""
    import torch

    if isinstance(value, torch.Tensor):
        return f"Tensor({tuple(value.shape)}; {value.dtype})"
    text = describe(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _plain(value: Any, depth: int = 0) -> bool:
    """A list or tuple of strings, numbers, booleans and None (or of such lists, one level down)."""
    return all(v is None or isinstance(v, (str, int, float, bool))
               or (depth == 0 and isinstance(v, (list, tuple)) and _plain(v, 1)) for v in value)


def mismatch(actual: Any, expected: Any, tol: Tol, where: str = "output", exact: Any = None,
             rule: ShadowRule = REFERENCE_ERROR) -> str | None:
    """None when `actual` matches `expected` within `tol`; otherwise the reason, for a learner.

    `exact`, when given, is the float64 shadow of `expected` (same structure): an element also passes
    when |actual − exact| ≤ rule.factor·|expected − exact| + rule.ulps ulps (see REFERENCE_ERROR).
    """
    import torch

    if isinstance(expected, torch.Tensor):
        return _tensor_mismatch(actual, expected, tol, where, exact if isinstance(exact, torch.Tensor) else None, rule)
    if type(expected).__module__ == "numpy" and hasattr(expected, "shape"):
        return _array_mismatch(actual, expected, tol, where)
    if isinstance(expected, (tuple, list)):
        if not isinstance(actual, (tuple, list)):
            return f"{where} should be a {type(expected).__name__} of {len(expected)}, got {describe(actual)}"
        if len(actual) != len(expected):
            n = len(expected)
            both = ""
            if _plain(expected) and _plain(actual):
                mine, theirs = describe(list(actual)), describe(list(expected))
                if len(mine) + len(theirs) <= 400 and not mine.startswith("list of"):
                    both = f": expected {theirs}, got {mine}"
            return f"{where} should have {n} item{'' if n == 1 else 's'}, got {len(actual)}{both}"
        for i, (a, e) in enumerate(zip(actual, expected)):
            # a record that names itself (a trace's {"boundary": ...}, a schedule's {"name": ...}) is named too
            label = next((e[k] for k in ("boundary", "name") if isinstance(e, dict) and isinstance(e.get(k), str)), "")
            problem = mismatch(a, e, tol, f"{where}[{i}]" + (f" ({label!r})" if label else ""),
                               _part(exact, i, (tuple, list)), rule)
            if problem:
                return problem
        return None
    if isinstance(expected, dict):
        if not isinstance(actual, dict):
            return f"{where} should be a dict with keys {sorted(expected)}, got {describe(actual)}"
        if set(actual) != set(expected):
            extra, missing = sorted(set(actual) - set(expected), key=str), sorted(set(expected) - set(actual), key=str)
            return (f"{where} should be a dict with keys {sorted(expected, key=str)}, got keys {sorted(actual, key=str)}"
                    + (f" (not expected: {extra})" if extra else "") + (f" (missing: {missing})" if missing else ""))
        for key in expected:
            problem = mismatch(actual[key], expected[key], tol, f"{where}[{key!r}]", _part(exact, key, dict), rule)
            if problem:
                return problem
        return None
    if isinstance(expected, bool) or expected is None or isinstance(expected, str):
        return None if actual == expected and type(actual) is type(expected) else (
            f"{where} should be {expected!r}, got {describe(actual)}")
    if isinstance(expected, (int, float)):
        # The reference answers with a Python number: so must the learner. A one-element tensor is not a
        # float (it carries a dtype and a device into every later use), and 8.0 is not the integer 8.
        if not isinstance(actual, (int, float)) or isinstance(actual, bool):
            one_number = isinstance(actual, torch.Tensor) and actual.numel() == 1
            return (f"{where} should be a Python {type(expected).__name__} like {expected!r}, got {describe(actual)}"
                    + (" (use .item() to take the number out of a tensor)" if isinstance(actual, torch.Tensor)
                       else "")
                    + (f"\n  trap: a one-number tensor returned where a Python {type(expected).__name__} is documented"
                       "\n    .item() (or float()) takes the number out: a tensor would carry its dtype and device "
                       "into every later use of it" if one_number else ""))
        if isinstance(expected, int) and not isinstance(expected, bool):
            if not isinstance(actual, int):
                return f"{where} should be the integer {expected}, got {actual!r} (a {type(actual).__name__})"
            if actual != expected:
                return f"{where} should be {expected}, got {actual!r}"
            return None
        if not math.isfinite(actual) and math.isfinite(expected):
            return f"{where} is {actual!r}; expected {_fmt(expected)}"
        if abs(actual - expected) > tol.atol + tol.rtol * abs(expected):
            shadow = ""
            if isinstance(exact, (int, float)) and math.isfinite(exact):
                # a Python float answer here is read off float32 tensors: its ulps are float32's
                yours, theirs = abs(actual - exact), abs(expected - exact)
                allowed = rule.factor * theirs + rule.ulps * 2.0**-23 * abs(exact)
                if yours <= allowed:
                    return None
                shadow = (f"\n  nor within the second allowance: |yours − exact| {_fmt(yours)}, allowed {_fmt(allowed)} "
                          f"= {rule.factor:g} × diffusers' own |diffusers − exact| ({_fmt(theirs)}) "
                          f"+ {rule.ulps:g} float32 ulps\n  {rule.describe('float32')}")
            return (f"{where} is {_fmt(actual)}; expected {_fmt(expected)} "
                    f"(|diff| {_fmt(abs(actual - expected))}; tolerance {tol.describe()})" + shadow)
        return None
    return None if actual == expected else f"{where} should be {describe(expected)}, got {describe(actual)}"


def scenario_mismatch(actual: Any, scenario, tol: Tol) -> str | None:
    """`mismatch` against a Scenario's expected value, its float64 shadow computed only where it is needed: the
    shadow lets through values the tolerance alone would not, never the other way, so an output within the
    tolerance passes without it (a deferred shadow, Scenario.exact as a function, is then never computed)."""
    problem = mismatch(actual, scenario.expected, tol)
    if problem is None or scenario.exact is None:
        return problem
    return mismatch(actual, scenario.expected, tol, exact=scenario.shadow())


def _part(exact: Any, key: Any, kind) -> Any:
    """The shadow of one item of a container (None where the shadow has no such container or item)."""
    if not isinstance(exact, kind):
        return None
    try:
        return exact[key]
    except (LookupError, TypeError):
        return None


def _tensor_mismatch(actual: Any, expected, tol: Tol, where: str, exact=None,
                     rule: ShadowRule = REFERENCE_ERROR) -> str | None:
    import torch

    if type(actual) is not torch.Tensor:
        # Exact type: a Tensor subclass or an object with a friendly __eq__ is not a tensor answer.
        return f"{where} should be a torch.Tensor, got {type(actual).__name__}: {describe(actual)}"
    if actual.shape != expected.shape:
        return (f"{where} has shape {tuple(actual.shape)}; expected {tuple(expected.shape)}"
                + _shape_hint(actual.shape, expected.shape))
    if actual.dtype != expected.dtype:
        return (f"{where} has dtype {actual.dtype}; expected {expected.dtype} "
                "(diffusers keeps the dtype it computes in: cast where the reference casts)")
    if actual.device != expected.device:
        return f"{where} is on device {actual.device}; expected {expected.device}"
    if actual.is_floating_point():
        a_bad = ~torch.isfinite(actual)
        e_bad = ~torch.isfinite(expected)
        if (a_bad & ~e_bad).any():
            idx = _index(torch.nonzero(a_bad & ~e_bad)[0])
            n = int((a_bad & ~e_bad).sum())
            return (f"{where} has {n} non-finite value(s) (nan/inf) where the reference is finite; "
                    f"first at index {idx}: yours {actual[idx].item()!r}, expected {_fmt(expected[idx].item())}")
    a = actual.detach().double()
    e = expected.detach().double()
    both_nonfinite_equal = ~torch.isfinite(e) & ((a == e) | (a.isnan() & e.isnan()))
    diff = (a - e).abs()
    diff = torch.where(both_nonfinite_equal, torch.zeros_like(diff), diff)
    diff = torch.nan_to_num(diff, nan=math.inf)
    allowed = tol.atol + tol.rtol * torch.nan_to_num(e.abs(), posinf=0.0)
    bad = diff > allowed
    shadow = None
    if bad.any() and exact is not None and exact.shape == expected.shape and expected.is_floating_point():
        # The float64 shadow: an element also passes when it is no further from exact math than
        # diffusers' own rounding allows. Where the shadow is not finite, only the tolerance applies.
        x = exact.detach().double()
        yours = torch.nan_to_num((a - x).abs(), nan=math.inf)
        theirs = (e - x).abs()
        ulps = rule.ulps * torch.finfo(expected.dtype).eps * x.abs()
        shadow_allowed = rule.factor * theirs + ulps
        shadow_allowed = torch.where(torch.isfinite(x) & torch.isfinite(shadow_allowed), shadow_allowed,
                                     torch.full_like(shadow_allowed, -1.0))
        bad = bad & ~(yours <= shadow_allowed)
        whole = _over_the_output(yours, theirs, x, bad, expected.dtype, rule)
        if whole is None:
            return None
        shadow = (x, yours, theirs, shadow_allowed, whole)
    if not bad.any():
        return None
    worst = int(torch.argmax(torch.where(bad, diff - allowed, torch.full_like(diff, -math.inf))))
    idx = _index(torch.tensor(list(_unravel(worst, tuple(e.shape)))))
    n_bad, n = int(bad.sum()), bad.numel()
    at = f" at index {idx}" if e.dim() else ""
    if shadow is None:
        return (
            f"{where} values differ: worst element{at}\n"
            f"    expected {_fmt(e[idx].item())}\n"
            f"    yours    {_fmt(a[idx].item())}\n"
            f"    |diff|   {_fmt(diff[idx].item())}, allowed {_fmt(allowed[idx].item())}\n"
            f"  {n_bad} of {n} elements ({100 * n_bad / n:.1f}%) are outside the tolerance\n"
            f"  tolerance: {tol.describe()}"
        )
    x, yours, theirs, shadow_allowed, whole = shadow
    dtype = str(expected.dtype).replace("torch.", "")
    return (
        f"{where} values differ: worst element{at}\n"
        f"    expected {_fmt(e[idx].item())} (diffusers)\n"
        f"    yours    {_fmt(a[idx].item())}\n"
        f"    exact    {_fmt(x[idx].item())} (the same math in float64 on the same inputs)\n"
        f"    1. |yours − diffusers| {_fmt(diff[idx].item())}, allowed {_fmt(allowed[idx].item())} "
        f"(the tolerance below)\n"
        f"    2. |yours − exact| {_fmt(yours[idx].item())}, allowed {_fmt(max(shadow_allowed[idx].item(), 0.0))} "
        f"= {rule.factor:g} × diffusers' own |diffusers − exact| ({_fmt(theirs[idx].item())}) + {rule.ulps:g} "
        f"{dtype} ulps\n"
        f"  {n_bad} of {n} elements ({100 * n_bad / n:.1f}%) are outside both\n"
        f"{whole}"
        f"  tolerance: {tol.describe()}\n"
        f"  {rule.describe(dtype)}"
    )


def _rms(t) -> float:
    return float(t.pow(2).mean().sqrt()) if t.numel() else 0.0


# Said of an output whose error is of rounding's size; withdrawn where a trap (a formula mistake) explains the output.
PRECISION_NOTE = ("  your error is of rounding's size, only larger than diffusers': a precision problem, not the formula. "
                  "Compute in the dtype diffusers computes in (float32 coefficients, the float16 tensor left as it is) "
                  "and cast once, at the end, if at all\n")


def _over_the_output(yours, theirs, x, bad, dtype, rule: ShadowRule) -> str | None:
    """None when the output as a whole is as close to exact math as diffusers' own: every element within
    rule.output_max_factor × diffusers' LARGEST error over the output (+ rule.ulps ulps at the element), and the
    RMS error within rule.output_rms_factor × diffusers' RMS error (core/tolerances.py says why).

    Rounding lands element by element by luck (diffusers is exact at one element, a correct formula in another
    order is not): judged against diffusers' error over the output, a correct answer is never failed by one
    element's luck, while a mistake at a few elements beyond diffusers' worst rounding, or rounding worse
    everywhere (float16 where diffusers upcasts), still fails. Otherwise the line saying so (and, where every
    error is within 16× those allowances, that it is precision)."""
    import torch

    finite = torch.isfinite(x) & torch.isfinite(theirs)
    if (bad & ~finite).any() or not torch.isfinite(yours[finite]).all():
        return "  judged over the output too: not where exact math is not finite, or yours is not\n"
    n = int(finite.sum())
    rms_factor = rule.output_rms_factor if n >= rule.output_min_elements else rule.factor
    theirs_max = float(theirs[finite].max())
    envelope = rule.output_max_factor * theirs_max + rule.ulps * torch.finfo(dtype).eps * x.abs()
    over = finite & (yours > envelope)
    mine_rms, theirs_rms = _rms(yours[finite]), _rms(theirs[finite])
    rms_allowed = rms_factor * theirs_rms
    if not over.any() and mine_rms <= rms_allowed:
        return None
    line = (f"    3. over the output: {int(over.sum())} element(s) beyond {rule.output_max_factor:g} × diffusers' "
            f"largest |diffusers − exact| ({_fmt(theirs_max)}) + {rule.ulps:g} ulps; your RMS |yours − exact| "
            f"{_fmt(mine_rms)}, allowed {_fmt(rms_allowed)} = {rms_factor:g} × diffusers' ({_fmt(theirs_rms)})\n"
            f"  an output passes when every element is within 1 or 2, or the whole output within 3\n")
    if mine_rms <= 16 * rms_allowed and bool((yours[finite] <= 16 * envelope[finite]).all()):
        line += PRECISION_NOTE
    return line


def _array_mismatch(actual: Any, expected, tol: Tol, where: str) -> str | None:
    """numpy outputs (images as "np" or uint8): type, shape and dtype first, then values as tensors."""
    import numpy as np
    import torch

    if type(actual) is not np.ndarray:
        return f"{where} should be a numpy.ndarray, got {type(actual).__name__}: {describe(actual)}"
    if actual.shape != expected.shape:
        return (f"{where} has shape {actual.shape}; expected {expected.shape}"
                + _shape_hint(torch.empty(actual.shape), torch.empty(expected.shape)))
    if actual.dtype != expected.dtype:
        return f"{where} has dtype {actual.dtype}; expected {expected.dtype}"
    return _tensor_mismatch(torch.from_numpy(np.ascontiguousarray(actual)),
                            torch.from_numpy(np.ascontiguousarray(expected)), tol, where)


def _unravel(flat: int, shape: tuple) -> tuple:
    out = []
    for size in reversed(shape):
        out.append(flat % size)
        flat //= size
    return tuple(reversed(out))


def _index(t) -> tuple:
    return tuple(int(i) for i in t.tolist())


def _shape_hint(got, want) -> str:
    if got.numel() == want.numel():
        return " (same number of elements: a reshape/transpose or a missing broadcast dimension?)"
    if len(got) != len(want):
        return " (a different number of dimensions: does a per-sample coefficient broadcast over (B, C, H, W)?)"
    return ""


def matches(actual: Any, candidate: Any, tol: Tol) -> bool:
    """Whether `actual` equals `candidate` (a trap's output) within `tol`."""
    try:
        return mismatch(actual, candidate, tol) is None
    except Exception:  # a trap's odd output must never break grading
        return False


def _leaves(value: Any) -> list:
    if isinstance(value, dict):
        return [leaf for v in value.values() for leaf in _leaves(v)]
    if isinstance(value, (list, tuple)):
        return [leaf for v in value for leaf in _leaves(v)]
    return [value]


def _numbers(value: Any) -> list:
    """_leaves, with numpy arrays as tensors (so leaves compare as numbers, never by an array's truth value)."""
    import torch

    leaves = _leaves(value)
    for i, leaf in enumerate(leaves):
        if type(leaf).__module__ == "numpy" and hasattr(leaf, "shape"):
            try:
                leaves[i] = torch.from_numpy(leaf.copy())
            except (TypeError, ValueError):
                pass  # an array of objects: compared as it is
    return leaves


def has_finite(value: Any) -> bool:
    """Whether an output holds at least one finite number. One with none (all NaN, say) matches every trap
    whose output is as broken: naming a misconception on it would be a guess, so no trap is named."""
    import torch

    for leaf in _leaves(value):
        if isinstance(leaf, torch.Tensor):
            if not leaf.is_floating_point() and not leaf.is_complex():
                return True
            if bool(torch.isfinite(leaf).any()):
                return True
        elif isinstance(leaf, bool) or not isinstance(leaf, (int, float)):
            return True  # a string, a dtype, None...: not numbers, so not a question of finiteness
        elif math.isfinite(leaf):
            return True
    return False


def distance(actual: Any, candidate: Any) -> float:
    """How far a trap's output is from the learner's: the largest absolute difference over every number
    (inf where they differ in structure). Where several traps match, the nearest explains the output best."""
    import torch

    mine, theirs = _numbers(actual), _numbers(candidate)
    if len(mine) != len(theirs):
        return math.inf
    worst = 0.0
    for a, b in zip(mine, theirs):
        if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
            if a.shape != b.shape:
                return math.inf
            if a.numel():
                d = (a.detach().double() - b.detach().double()).abs()
                same = (a.detach().double() == b.detach().double()) | (a.isnan() & b.isnan()) if \
                    a.is_floating_point() and b.is_floating_point() else None
                if same is not None:
                    d = torch.where(same, torch.zeros_like(d), d)
                worst = max(worst, float(torch.nan_to_num(d, nan=math.inf).max()))
        elif isinstance(a, (int, float)) and isinstance(b, (int, float)) and not isinstance(a, bool):
            worst = max(worst, 0.0 if a == b or (a != a and b != b) else abs(a - b) if math.isfinite(a - b) else math.inf)
        else:
            try:
                if bool(a != b):
                    return math.inf
            except Exception:  # noqa: BLE001  (leaves that cannot be compared are not the same)
                return math.inf
    return worst


def closeness(actual: Any, candidate: Any, expected: Any) -> float:
    """How near the learner's output is to a trap's: the root of the summed squared differences to the trap's
    output, over the smallest of those from the learner's output to the right answer, from the trap's output to
    the right answer, and of the trap's output itself (every number; inf where the structure, or anything that is
    not a float, differs from the trap's; where a tensor has the trap's shape and not the answer's, the trap's own
    size alone). 0 is the trap's output exactly; a small value (core.tolerances.
    TRAP_NEAR) is a near variant of the trap's mistake, computed another way or in another precision. Measured
    against the smallest of the three, an answer far from everything (x̂₀ at t = 999) makes nothing near."""
    import torch

    mine, theirs, right = _numbers(actual), _numbers(candidate), _numbers(expected)
    if not len(mine) == len(theirs) == len(right):
        return math.inf
    sums = {"to trap": 0.0, "to answer": 0.0, "trap to answer": 0.0, "trap": 0.0}

    def add(key: str, x, y) -> None:  # Σ (x − y)² in float64, NaN against NaN counting as equal
        d = x - y
        d = torch.where((x == y) | (x.isnan() & y.isnan()), torch.zeros_like(d), d)
        sums[key] += float(torch.nan_to_num(d, nan=math.inf, posinf=math.inf, neginf=math.inf).pow(2).sum())

    for a, b, c in zip(mine, theirs, right):
        if all(isinstance(v, float) for v in (a, b, c)):
            a, b, c = (torch.tensor(v, dtype=torch.float64) for v in (a, b, c))
        if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and isinstance(c, torch.Tensor) \
                and a.is_floating_point() and b.is_floating_point() and c.is_floating_point():
            if a.shape != b.shape:
                return math.inf
            x, y = (t.detach().to("cpu", torch.float64) for t in (a, b))
            add("to trap", x, y)
            add("trap", y, torch.zeros_like(y))
            if c.shape != a.shape:  # the trap's shape, not the answer's: measured against the trap's own size
                sums["to answer"] = sums["trap to answer"] = math.inf
                continue
            z = c.detach().to("cpu", torch.float64)
            add("to answer", x, z)
            add("trap to answer", y, z)
            continue
        try:
            same = torch.equal(a, b) if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) else bool(a == b)
        except Exception:  # noqa: BLE001  (an odd leaf never breaks grading: no explanation)
            same = False
        if not same:
            return math.inf
    if sums["to trap"] == 0.0:
        return 0.0
    scale = min(sums["to answer"], sums["trap to answer"], sums["trap"])
    if not math.isfinite(sums["to trap"]) or scale == 0.0 or not math.isfinite(scale):
        return math.inf  # no finite yardstick (every distance infinite): near means nothing, only a match names
    return math.sqrt(sums["to trap"] / scale)
