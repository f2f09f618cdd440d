"""runtime.flags: a dataclass's fields as options, and back (the CLI's flag groups)."""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from inspect import signature
from typing import Annotated, Any

import pytest

from runtime.config import EngineFlags
from runtime.flags import (
    FlagGroup,
    Typed,
    build_group,
    comma_list,
    command_layout,
    expand_groups,
    flag,
    given_options,
    group_specs,
)


@dataclass(frozen=True, slots=True)
class Demo:
    rate: float = flag(math.inf, "--request-rate", "Requests/s.", "Workload")
    blocks: int | None = flag(None, "--num-blocks", None, "Engine", short="-n")
    caching: bool = flag(True, "--caching/--no-caching")
    internal: int = 3  # no flag metadata: never an option

    def __post_init__(self) -> None:
        if self.blocks is not None and self.blocks < 1:
            raise ValueError(f"--num-blocks must be >= 1, got {self.blocks}")


def test_specs_name_type_default_and_panel() -> None:
    specs = group_specs(Demo, FlagGroup())
    assert [s.name for s in specs] == ["request_rate", "num_blocks", "caching"]
    rate, blocks, caching = specs
    assert (rate.field, rate.decls, rate.default, rate.panel) == (
        "rate", ("--request-rate",), math.inf, "Workload")
    assert (blocks.decls, blocks.scalar, blocks.default) == (("--num-blocks", "-n"), int, None)
    assert caching.decls == ("--caching/--no-caching",) and caching.name == "caching"


def test_only_exclude_defaults_and_panel_override() -> None:
    group = FlagGroup(only=("rate", "blocks"), exclude=("blocks",), defaults={"rate": 8.0},
                      panel="Mine")
    [spec] = group_specs(Demo, group)
    assert (spec.field, spec.default, spec.panel) == ("rate", 8.0, "Mine")


def test_build_round_trip_and_validation() -> None:
    group = FlagGroup()
    specs = group_specs(Demo, group)
    built = build_group(Demo, group, specs, {"request_rate": 2.0, "num_blocks": 7,
                                             "caching": False})
    assert built == Demo(rate=2.0, blocks=7, caching=False)
    with pytest.raises(ValueError, match="--num-blocks must be >= 1, got 0"):
        build_group(Demo, group, specs, {"request_rate": 2.0, "num_blocks": 0,
                                         "caching": True})


def test_lists_give_typed_values_only_for_given_flags() -> None:
    group = FlagGroup(only=("max_num_seqs", "block_size"), lists=True)
    specs = group_specs(EngineFlags, group)
    assert all(s.hint == str | None and s.default is None for s in specs)
    built = build_group(EngineFlags, group, specs, {"max_num_seqs": "64, 256",
                                                    "block_size": None})
    assert built == {"max_num_seqs": [64, 256]}


def test_comma_list_errors_name_the_option() -> None:
    assert comma_list("--x", "1.5,2", float) == [1.5, 2.0]
    with pytest.raises(ValueError, match=r"--max-num-seqs: not a comma-separated list of int "
                       r"values: '8,a'"):
        comma_list("--max-num-seqs", "8,a", int)
    with pytest.raises(ValueError, match="--x: empty list"):
        comma_list("--x", " , ", int)
    with pytest.raises(ValueError, match=r"^--x: '2.0' given twice \(each value is run "
                       r"once\)$"):
        comma_list("--x", "1, 2, 2.0", float)  # badinput23b: once run twice


def test_every_engine_flag_is_declared_with_vllms_name() -> None:
    names = [s.decls[0] for s in group_specs(EngineFlags, FlagGroup())]
    assert names == ["--max-num-batched-tokens", "--max-num-seqs", "--max-model-len",
                     "--block-size", "--enable-prefix-caching/--no-enable-prefix-caching",
                     "--enable-chunked-prefill/--no-enable-chunked-prefill",
                     "--long-prefill-token-threshold", "--policy", "--num-gpu-blocks-override"]


@dataclass(frozen=True, slots=True)
class Other:
    caching: bool = flag(True, "--caching/--no-caching")  # shared with Demo
    model: str | None = flag(None, "--model", None, "Real engine", alias="--sim-model")


def test_layout_lists_own_and_inline_options_first_and_a_shared_one_once() -> None:
    order, groups = command_layout([
        ("demo", (Demo, FlagGroup(only=("rate", "caching")))), ("path", None),
        ("other", (Other, FlagGroup(inline=True))), ("out", None)])
    names = [x if isinstance(x, str) else x.name for x in order]
    assert names == ["path", "caching", "model", "out", "request_rate"]
    assert [(g.name, [s.name for s in g.specs]) for g in groups] == [
        ("other", ["caching", "model"]), ("demo", ["request_rate", "caching"])]
    assert groups[0].specs[1].decls == ("--model", "--sim-model")


class _BadFlag(Exception):
    pass


@contextmanager
def _guard() -> Iterator[None]:
    try:
        yield
    except ValueError as err:
        raise _BadFlag(str(err)) from None


def test_expand_groups_without_a_parser_library() -> None:
    """`expand_groups` with a plain `option` (the spec itself as the annotation): the group's
    options become keyword parameters after the plain ones, and a bad value goes through
    the guard."""
    seen: list[Any] = []

    def command(demo: Annotated[Demo, FlagGroup(only=("rate", "blocks"))], n: int = 1) -> None:
        seen.append((demo, n))

    expanded = expand_groups(command, lambda spec: spec, _guard)
    params = signature(expanded).parameters
    assert list(params) == ["n", "request_rate", "num_blocks"]
    assert params["num_blocks"].annotation.decls == ("--num-blocks", "-n")
    expanded(n=2, request_rate=4.0, num_blocks=7)
    assert seen == [(Demo(rate=4.0, blocks=7), 2)]
    with pytest.raises(_BadFlag, match="--num-blocks must be >= 1, got 0"):
        expanded(n=2, request_rate=4.0, num_blocks=0)
    assert len(seen) == 1


def test_typed_names_a_flag_given_at_its_default() -> None:
    """leftovers24: `given_options` once compared each flag with its default, so a flag of
    another mode typed at its default value was accepted (and ignored)."""
    seen: list[tuple[Demo, Typed]] = []

    def command(demo: Annotated[Demo, FlagGroup(only=("rate", "caching"))],
                typed: Typed) -> None:
        seen.append((demo, typed))

    expanded = expand_groups(command, lambda spec: spec, _guard,
                             given=lambda name: name in ("request_rate", "caching"))
    assert list(signature(expanded).parameters) == ["request_rate", "caching"]
    expanded(request_rate=math.inf, caching=True)  # both typed, at their default
    [(demo, typed)] = seen
    assert typed.fields(demo) == {"rate", "caching"}
    assert given_options(demo) == []  # by value: nothing differs from its default
    assert given_options(demo, typed=typed) == ["--request-rate inf", "--caching"]
    assert given_options(demo, ("caching",), typed) == ["--caching"]
    copy = Demo(rate=2.0)  # not built from the command line: by value
    assert typed.fields(copy) is None and given_options(copy, typed=typed) == [
        "--request-rate 2.0"]


def test_typed_without_a_source_knows_nothing() -> None:
    seen: list[Typed] = []

    def command(demo: Annotated[Demo, FlagGroup()], typed: Typed) -> None:
        seen.append(typed)

    expand_groups(command, lambda spec: spec, _guard)(request_rate=1.0, num_blocks=None,
                                                       caching=True)
    assert seen == [Typed()]


@pytest.mark.parametrize("size", [1, 7, 8, 24, 100])
def test_block_size_is_a_multiple_of_16_as_vllms_cuda_backends_take(size: int) -> None:
    """`vllm serve --block-size 8` is refused on CUDA (the attention backend's kernel block
    sizes are multiples of 16); rt took any size >= 1 (badinput23)."""
    with pytest.raises(ValueError, match=f"--block-size must be a multiple of 16.*got {size}"):
        EngineFlags(block_size=size)


def test_block_sizes_vllm_takes_are_taken() -> None:
    assert [EngineFlags(block_size=s).block_size for s in (16, 32, 48, 128, 512)] == [
        16, 32, 48, 128, 512]
