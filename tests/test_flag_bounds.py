"""Every flag with a range carries it (`flag(..., at_least=...)`): a config just outside it is refused with one
line naming the flag, the value and the range, whichever config declares it; no hand-written range check is left
to drift from it."""
import dataclasses
import importlib
import pathlib
import pkgutil
import re

import pytest

import megatron_ais
from megatron_ais.errors import ArgumentValidationError
from megatron_ais.flags import FlagBounds, FlagConfig, _flag_fields, option_name

PACKAGE = pathlib.Path(megatron_ais.__file__).parent


def _flag_configs() -> list[type]:
    for module in pkgutil.walk_packages(megatron_ais.__path__, "megatron_ais."):
        importlib.import_module(module.name)
    found, todo = [], list(FlagConfig.__subclasses__())
    while todo:
        cls = todo.pop()
        found.append(cls)
        todo.extend(cls.__subclasses__())
    return sorted(found, key=lambda cls: cls.__qualname__)


def _outside(bounds: FlagBounds, is_int: bool) -> list:
    """Values just outside each bounded side."""
    step = 1 if is_int else 0.5
    values = []
    if bounds.low is not None:
        values.append(bounds.low if bounds.low_strict else bounds.low - step)
    if bounds.high is not None:
        values.append(bounds.high if bounds.high_strict else bounds.high + step)
    return values


BOUNDED = [(cls, field, spec) for cls in _flag_configs() for field, spec in _flag_fields(cls) if spec.bounds]


def test_the_bounded_flags_include_the_loops_and_the_engines():
    names = {option_name(field, spec) for _, field, spec in BOUNDED}
    assert {"--grpo-steps", "--group-size", "--temperature", "--top-p", "--max-off-policy-steps", "--micro-batch-size",
            "--rollout-min-engines", "--keep-checkpoints", "--is-cap", "--tensor-model-parallel-size", "--lr",
            "--adam-beta1", "--adam-beta2", "--adam-eps", "--weight-decay", "--seed", "--global-batch-size"} <= names
    assert len(BOUNDED) >= 52


@pytest.mark.parametrize("cls,field,spec", BOUNDED, ids=[option_name(f, s) for _, f, s in BOUNDED])
def test_a_value_outside_the_bounds_is_refused_with_its_flag_value_and_range(cls, field, spec):
    default = cls()  # the defaults lie inside every bound
    is_int = isinstance(field.default, int) or "int" in str(field.type)
    for value in _outside(spec.bounds, is_int):
        with pytest.raises(ArgumentValidationError) as raised:
            dataclasses.replace(default, **{field.name: value})
        message = str(raised.value)
        assert message.startswith(f"{option_name(field, spec)} {value} must be "), message
        assert "\n" not in message
    with pytest.raises(ArgumentValidationError, match="must be"):
        dataclasses.replace(default, **{field.name: float("nan")})


FLOATS = [(cls, field, spec) for cls in _flag_configs() for field, spec in _flag_fields(cls)
          if isinstance(field.default, float) or (isinstance(field.default, tuple) and field.default
                                                  and isinstance(field.default[0], float))]


@pytest.mark.parametrize("cls,field,spec", FLOATS, ids=[option_name(f, s) for _, f, s in FLOATS])
def test_no_float_flag_takes_nan_or_infinity(cls, field, spec):
    # --adam-eps inf made every update a no-op, --lr inf wrote NaN weights, --kl-coef nan was accepted
    for bad in (float("nan"), float("inf"), float("-inf")):
        value = tuple(bad for _ in field.default) if isinstance(field.default, tuple) else bad
        with pytest.raises(ArgumentValidationError, match=f"^{re.escape(option_name(field, spec))} .* must be "):
            dataclasses.replace(cls(), **{field.name: value})


@pytest.mark.parametrize("bounds,inside,outside,words", [
    (FlagBounds(low=1), [1, 7], [0, -3], "at least 1"),
    (FlagBounds(low=0, low_strict=True), [1e-9, 2.0], [0.0, -1.0], "> 0"),
    (FlagBounds(low=0, high=1, low_strict=True), [0.5, 1.0], [0.0, 1.5], "in (0, 1]"),
    (FlagBounds(low=0, high=1, high_strict=True), [0.0, 0.99], [1.0, -0.1], "in [0, 1)"),
    (FlagBounds(high=4), [4, -10], [5], "at most 4"),
])
def test_bounds_hold_inside_and_not_outside(bounds, inside, outside, words):
    assert all(bounds.holds(v) for v in inside) and not any(bounds.holds(v) for v in outside)
    assert bounds.describe() == words


def test_no_hand_written_range_check_of_a_single_flag_is_left():
    # a flag against a constant (a rule between two flags, "must be at most --other", stays hand-written)
    pattern = re.compile(r'f"--[a-z0-9-]+ \{self\.\w+\} must be (at least|at most|positive|>|>=|<|in [\[(])(?! --)')
    found = [f"{path.relative_to(PACKAGE)}: {m.group(0)}" for path in PACKAGE.rglob("*.py")
             for m in pattern.finditer(path.read_text())]
    assert not found, found
