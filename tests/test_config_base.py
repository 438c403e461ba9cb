"""xhc.config_base: the one strict loader of every config dataclass (docs/architecture.md)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import ClassVar, Dict, List, Optional, Tuple

import pytest

from xhc.config_base import ConfigBase, ConfigKeyError, set_dotted, split_override


class _Err(ValueError):
    pass


@dataclass
class _Inner(ConfigBase):
    lr: float = 1e-3
    betas: Tuple[float, float] = (0.9, 0.95)
    tags: List[str] = field(default_factory=list)


@dataclass
class _Outer(ConfigBase):
    config_error: ClassVar[type] = _Err
    key_format: ClassVar[str] = "key {key}: {msg}"
    coerce_values: ClassVar[bool] = True

    steps: int = 10
    name: Optional[str] = None
    inner: _Inner = field(default_factory=lambda: _Inner(lr=0.5))
    extra: Dict[str, int] = field(default_factory=dict)


@dataclass
class _Checked(ConfigBase):
    """Validates at construction, as HCConfig / OptimizerConfig / ScheduleConfig do."""

    config_error: ClassVar[type] = _Err
    unknown_key_format: ClassVar[str] = "_Checked has no field {name!r}; known fields: {known}"
    n: int = 4

    def __post_init__(self):
        if self.n < 1:
            raise _Err(f"n={self.n} must be >= 1")


def test_nested_sections_keep_their_defaults_and_values_are_converted():
    cfg = _Outer.from_dict({"steps": "2e1", "name": "null", "inner": {"betas": [0.8, "0.99"], "tags": "a"}})
    assert cfg.steps == 20 and isinstance(cfg.steps, int) and cfg.name is None
    assert cfg.inner.lr == 0.5  # the section's default (from the outer default factory), not _Inner()'s
    assert cfg.inner.betas == (0.8, 0.99) and cfg.inner.tags == ["a"]
    assert _Outer.from_dict({"inner": None}).inner == _Inner(lr=0.5)


@pytest.mark.parametrize("data, message", [
    ({"stepz": 1}, "key stepz: unknown key; known keys of the config: extra, inner, name, steps"),
    ({"inner": {"lrr": 1}}, "key inner.lrr: unknown key; known keys of inner: betas, lr, tags"),
    ({"steps": "ten"}, "key steps: 'ten' is not an integer"),
    ({"inner": {"betas": [0.9]}}, "key inner.betas: [0.9] needs 2 entries"),
    ({"inner": 3}, "key inner: expected a mapping, got 3"),
    ({"extra": [1]}, "key extra: [1] is not a mapping"),
])
def test_errors_are_one_line_naming_the_dotted_key(data, message):
    with pytest.raises(_Err) as e:
        _Outer.from_dict(data)
    assert str(e.value) == message


def test_without_coercion_the_class_validates_at_construction():
    assert _Checked.from_dict({"n": 2}) == _Checked(2)
    with pytest.raises(_Err, match=r"^n=0 must be >= 1$"):
        _Checked.from_dict({"n": 0})
    with pytest.raises(_Err, match=r"^_Checked has no field 'm'; known fields: n$"):
        _Checked.from_dict({"m": 1})
    with pytest.raises(_Err, match="must be >= 1"):
        _Checked(2).replace(n=0)


def test_to_dict_is_plain_and_round_trips():
    cfg = _Outer.from_dict({"inner": {"betas": [0.8, 0.9], "tags": ["x"]}, "extra": {"a": 1}})
    d = cfg.to_dict()
    assert d == {"steps": 10, "name": None, "inner": {"lr": 0.5, "betas": [0.8, 0.9], "tags": ["x"]},
                 "extra": {"a": 1}}
    assert _Outer.from_dict(d) == cfg
    assert not any(dataclasses.is_dataclass(v) for v in d.values())


def test_dotted_overrides():
    assert split_override("--optimizer.lr=1e-3", "a.b=1") == ("optimizer.lr", "1e-3")
    with pytest.raises(ValueError, match=r"^override 'lr': write section.key=value, e.g. a.b=1$"):
        split_override("lr", "a.b=1")
    with pytest.raises(ValueError, match=r"must be dotted, section.key \(e.g. a.b=1\)"):
        split_override("lr=3", "a.b=1")
    raw = {"inner": None}
    set_dotted(raw, "inner.lr", 2.0)
    set_dotted(raw, "extra.a", 1, sections=["inner", "extra"])
    assert raw == {"inner": {"lr": 2.0}, "extra": {"a": 1}}
    assert _Outer.from_dict(raw).inner.lr == 2.0
    with pytest.raises(ConfigKeyError, match=r"^foo.x: unknown section 'foo'; sections: inner, extra$"):
        set_dotted(raw, "foo.x", 1, sections=["inner", "extra"])
    with pytest.raises(ConfigKeyError, match=r"^inner.lr: is a value \(2.0\), not a section; cannot set inner.lr.x$"):
        set_dotted(raw, "inner.lr.x", 1)


def test_every_config_dataclass_uses_the_base():
    from training.config import PretrainConfig
    from training.data.gpt import DataConfig
    from training.finetune import FinetuneConfig
    from training.optim import OptimizerConfig
    from training.schedule import ScheduleConfig
    from xhc.config import HCConfig

    sections = [type(getattr(PretrainConfig(), f.name)) for f in dataclasses.fields(PretrainConfig)]
    sections += [type(getattr(FinetuneConfig(), f.name)) for f in dataclasses.fields(FinetuneConfig) if f.name != "hc"]
    for cls in [HCConfig, OptimizerConfig, ScheduleConfig, DataConfig, PretrainConfig, FinetuneConfig] + sections:
        assert issubclass(cls, ConfigBase), cls
        assert "from_dict" not in vars(cls) or cls in (DataConfig, FinetuneConfig), cls  # one loader


def test_variant_and_backend_names_have_one_definition():
    """xhc/config.py defines the variant and kernel backend names; no other product file spells one of
    those tuples out again, in the same order (an AST walk over tuple/list/set literals of strings)."""
    import ast
    from pathlib import Path

    from xhc import config as C

    names = {"VARIANTS": C.VARIANTS, "MHC_FAMILY": C.MHC_FAMILY, "XHC_FAMILY": C.XHC_FAMILY,
             "FLASH_FAMILY": C.FLASH_FAMILY, "OP_BACKENDS": C.OP_BACKENDS, "KERNEL_BACKENDS": C.KERNEL_BACKENDS}
    groups = {tuple(v): k for k, v in names.items()}
    groups[tuple(b for b in C.KERNEL_BACKENDS if b != "auto")] = "KERNEL_BACKENDS without auto"
    groups[tuple(v for v in C.VARIANTS if v != "none")] = "VARIANTS without none"
    root = Path(__file__).resolve().parent.parent
    again = []
    for pkg in ("xhc", "models", "training", "tools", "bench"):
        for path in sorted((root / pkg).rglob("*.py")):
            if path == root / "xhc" / "config.py":
                continue
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                if isinstance(node, (ast.Tuple, ast.List, ast.Set)) and len(node.elts) >= 2 and all(
                        isinstance(e, ast.Constant) and isinstance(e.value, str) for e in node.elts):
                    found = groups.get(tuple(e.value for e in node.elts))
                    if found:
                        again.append(f"{path.relative_to(root)}:{node.lineno} spells out {found}")
    assert not again, "import the names from xhc.config instead:\n" + "\n".join(again)
