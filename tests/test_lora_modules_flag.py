"""The vLLM worker's ``--lora-modules`` (vLLM's server flag: ``NAME=PATH`` or its JSON form) and
``DYN_LORA_MODULES``, parsed without vLLM; a bad item is a clear ``InvalidArgument``. The
adapters' loading itself runs against vLLM in tests/test_vllm_lora.py."""

from __future__ import annotations

import argparse
import json

import pytest

from dynamo_zmq import errors
from engines.vllm import VllmEngine, VllmOptions
from engines.vllm._lora import parse_modules
from engines.vllm._options import add_adapter_args, options_from_args


def _parse(argv: list[str]) -> VllmOptions:
    parser = argparse.ArgumentParser()
    add_adapter_args(parser)
    return options_from_args(parser.parse_args(argv))


def test_name_equals_path_and_vllms_json_form() -> None:
    item = json.dumps({"name": "b", "path": "/l/b", "base_model_name": "tiny"})
    opts = _parse(["--lora-modules", "a=/l/a", item, "c=/l/with=sign"])
    assert opts.lora_modules == (("a", "/l/a"), ("b", "/l/b"), ("c", "/l/with=sign"))
    assert _parse([]).lora_modules == ()


def test_the_variable_takes_spaces_or_a_json_list(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DYN_LORA_MODULES", "a=/l/a  b=/l/b")
    assert _parse([]).lora_modules == (("a", "/l/a"), ("b", "/l/b"))
    monkeypatch.setenv("DYN_LORA_MODULES", json.dumps(["a=/l/a", {"name": "b", "path": "/l/b"}]))
    assert _parse([]).lora_modules == (("a", "/l/a"), ("b", "/l/b"))
    assert _parse(["--lora-modules", "c=/l/c"]).lora_modules == (("c", "/l/c"),)  # flag wins


@pytest.mark.parametrize(("item", "why"), [
    ("no-equals-sign", "neither NAME=PATH nor JSON"),
    ("=/l/a", "empty name or path"),
    ("a=", "empty name or path"),
    ('{"name": "a"}', '"name" and "path" must be strings'),
    ('{"name": "a", "path": "/l", "rank": 8}', "an object with"),
    ('["a=/l"]', "an object with"),
])
def test_a_bad_item_is_invalid_argument(item: str, why: str) -> None:
    with pytest.raises(errors.InvalidArgument, match="--lora-modules") as exc:
        parse_modules([item])
    assert why in str(exc.value)


def test_a_name_given_twice_is_refused() -> None:
    with pytest.raises(errors.InvalidArgument, match="'a' is given twice"):
        parse_modules(["a=/l/a", "a=/l/b"])


def test_adapters_at_start_need_enable_lora() -> None:
    with pytest.raises(errors.InvalidArgument, match="--lora-modules needs --enable-lora"):
        VllmEngine({"model": "m"}, VllmOptions(lora_modules=(("a", "/l/a"),)))
    VllmEngine({"model": "m", "enable_lora": True}, VllmOptions(lora_modules=(("a", "/l/a"),)))
