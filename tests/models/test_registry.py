"""The model registry (models/registry.py) is the one place a model type meets its family:
the loader builds through it and imports no family, and no family imports the loader."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from import_graph import PACKAGE, graph, reachable, read_imports
from torch import nn

from deepinfer_dp.models import registry

MODELS = f"{PACKAGE}.models"


@pytest.fixture(scope="module")
def edges() -> dict[str, set[str]]:
    """The imports that run (a TYPE_CHECKING import names a type and loads nothing)."""
    return graph([imp for imp in read_imports().imports if not imp.type_only])


def test_every_registered_type_builds_a_model_class():
    for model_type in registry.supported_model_types():
        cls = registry.model_class(SimpleNamespace(model_type=model_type))
        assert issubclass(cls, nn.Module) and isinstance(cls.mixture_of_experts, bool), model_type
    moe = {t for t in registry.supported_model_types()
           if registry.model_class(SimpleNamespace(model_type=t)).mixture_of_experts}
    assert moe == {"mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "deepseek_v2", "deepseek_v3"}


def test_an_unknown_type_is_refused_by_name():
    config = SimpleNamespace(model_type="gpt2", architectures=["GPT2LMHeadModel"])
    with pytest.raises(ValueError, match=r"GPT2LMHeadModel.*model_type 'gpt2'.*llama"):
        registry.model_class(config)


def test_the_loader_imports_no_family(edges):
    families = set(registry.family_modules())
    names = ("llama", "gemma3", "moe_models", "deepseek", "llava", "idefics3", "qwen2_vl")
    assert families == {f"{MODELS}.{name}" for name in names}
    pulled_in = families & reachable(edges, f"{MODELS}.loader")
    assert not pulled_in, f"models/loader.py imports families (through its imports): {sorted(pulled_in)}"


def test_no_family_imports_the_loader_or_the_registry(edges):
    for family in registry.family_modules():
        back = {f"{MODELS}.loader", f"{MODELS}.registry"} & reachable(edges, family)
        assert not back, f"{family} imports {sorted(back)}"
