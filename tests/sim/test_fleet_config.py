"""Fleet files: pools of replicas from TOML, and one-line errors naming field and value."""

from __future__ import annotations

from pathlib import Path

import pytest

from sim.fleet_config import build_fleet, load_fleet, parse_fleet

FLEET = """
[[pool]]
name = "small"
count = 2
gpu = "h200"
model = "llama-3.1-8b"
cost_per_hour = 3.5
[pool.engine]
max_num_seqs = 64
enable_prefix_caching = false

[[pool]]
name = "big"
count = 1
gpu = "h200"
model = "llama-3.1-70b"
tensor_parallel_size = 4
profile = "calibrated"
"""


def test_pools_become_replicas_in_file_order(tmp_path: Path) -> None:
    path = tmp_path / "fleet.toml"
    path.write_text(FLEET)
    spec = load_fleet(path)
    assert spec.num_replicas == 3
    assert spec.pool_of_replica() == ["small", "small", "big"]
    small, big = spec.pools
    assert (small.count, small.cost_per_hour, small.engine_args.max_num_seqs) == (2, 3.5, 64)
    assert small.engine_args.enable_prefix_caching is False
    assert (big.engine_args.tensor_parallel_size, big.cost_per_hour, big.profile) == (
        4, 0.0, "calibrated")


def test_each_replica_gets_its_pool_setup() -> None:
    spec = parse_fleet(FLEET.replace('profile = "calibrated"\n', ""))
    setups = build_fleet(spec, seed=3)
    assert [s.model.name for s in setups] == ["Llama-3.1-8B"] * 2 + ["Llama-3.1-70B"]
    assert setups[0] is setups[1]
    assert setups[0].config.scheduler.max_num_seqs == 64
    assert setups[2].engine_args.tensor_parallel_size == 4
    assert setups[0].config.cache.num_blocks != setups[2].config.cache.num_blocks


@pytest.mark.parametrize(("edit", "message"), [
    (("count = 2", "count = 0"), "pool 'small': count must be an integer >= 1, got 0"),
    (("count = 2", "count = true"), "pool 'small': count must be an integer >= 1, got True"),
    (('name = "big"\n', ""), "pool 2: missing field 'name'"),
    (('gpu = "h200"\nmodel = "llama-3.1-70b"', 'model = "llama-3.1-70b"'),
     "pool 'big': missing field 'gpu'"),
    (("count = 1", "count = 1\ngpus = 2"), "pool 'big': unknown field 'gpus'"),
    (("max_num_seqs", "max_seqs"), "pool 'small': unknown engine flag 'max_seqs'"),
    (("= 64", '= "x"'), "pool 'small': engine flag max_num_seqs must be int, got 'x'"),
    (("cost_per_hour = 3.5", "cost_per_hour = -1"),
     "pool 'small': cost_per_hour must be a number >= 0, got -1"),
    (("cost_per_hour = 3.5", "cost_per_hour = 1e308"),
     "pool 'small': cost_per_hour must be at most 10000 $ per GPU (1 GPUs), got 1e+308"),
    (('name = "big"', 'name = "small"'), "pool name 'small' is used twice"),
    (("[[pool]]", "pools = 1\n[[pool]]"), "unknown table or key 'pools'"),
    (("[[pool]]", "[[pool"), "not valid TOML"),
    (("[[pool]]", "x = " + "[" * 100_000 + "]" * 100_000 + "\n[[pool]]"),
     "not valid TOML: nested too deeply"),  # was tomllib's RecursionError
    # badinput4: the last spelling won without a word
    (("max_num_seqs = 64", "max_num_seqs = 64\nmax-num-seqs = 8"),
     "pool 'small': engine flag max_num_seqs is given twice ('max_num_seqs' and "
     "'max-num-seqs')"),
    # badinput4: 4096 per pool, any number of pools (30 x 4096: 1.9 GB, 18 s for 4 requests)
    (("count = 2", "count = 4096"), "the pools' counts sum to 4,097 replicas; a fleet holds "
     "at most 4096"),
])
def test_bad_fleet_files_name_the_field_and_value(edit: tuple[str, str], message: str) -> None:
    with pytest.raises(ValueError, match="^[^\n]*$") as error:
        parse_fleet(FLEET.replace(*edit, 1))
    assert message in str(error.value)


@pytest.mark.parametrize(("edit", "message"), [
    (('gpu = "h200"', 'gpu = "h999"'), "pool 'small': unknown GPU 'h999'"),
    (("llama-3.1-70b", "no-such-model"), "pool 'big': unknown model 'no-such-model'"),
    (("tensor_parallel_size = 4", 'tensor_parallel_size = 1\n[pool.engine]\n'
      "gpu_memory_utilization = 0.3"), "pool 'big': Llama-3.1-70B does not fit"),
])
def test_bad_pools_fail_when_built(edit: tuple[str, str], message: str) -> None:
    spec = parse_fleet(FLEET.replace('profile = "calibrated"\n', "").replace(*edit, 1))
    with pytest.raises(ValueError, match="^[^\n]*$") as error:
        build_fleet(spec)
    assert message in str(error.value)


def test_a_missing_file_is_one_line(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="cannot read fleet file"):
        load_fleet(tmp_path / "nope.toml")


def test_a_file_that_is_not_utf8_is_one_line_naming_it(tmp_path: Path) -> None:
    """badinput4: "'utf-8' codec can't decode byte 0xff in position 0", the file unnamed."""
    path = tmp_path / "fleet.toml"
    path.write_bytes(b"\xff\xfe" + FLEET.encode())
    with pytest.raises(ValueError) as error:
        load_fleet(path)
    assert str(error.value) == f"{path}: not valid TOML: not UTF-8 text (byte 0)"


def test_a_fleet_of_4096_replicas_in_several_pools_is_taken() -> None:
    assert parse_fleet(FLEET.replace("count = 2", "count = 4095")).num_replicas == 4096
