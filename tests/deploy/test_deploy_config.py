"""The deployment config: the shipped examples load, defaults, round trips, and an error
message for each way a config can be wrong (no Ray, no torch)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from deploy.config import ConfigError, DeployConfig, GatewaySettings, PoolConfig

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = sorted((ROOT / "deploy" / "configs").glob("*.yaml"))


def load(tmp_path: Path, text: str) -> DeployConfig:
    path = tmp_path / "x.yaml"
    path.write_text(text)
    return DeployConfig.from_yaml(path)


def test_the_examples_are_there():
    assert {p.name for p in CONFIGS} >= {"cpu-single-node.yaml", "gpu-8x-node.yaml", "multi-node.yaml"}


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_every_example_loads_and_round_trips(path):
    config = DeployConfig.from_yaml(path)
    assert config.decode.replicas >= 1
    assert DeployConfig.from_dict(config.to_dict()) == config


def test_examples_say_what_they_promise():
    cpu, gpu, multi = (DeployConfig.from_yaml(ROOT / "deploy" / "configs" / f"{name}.yaml")
                       for name in ("cpu-single-node", "gpu-8x-node", "multi-node"))
    assert cpu.model == "smollm2" and cpu.prefill.replicas == cpu.decode.replicas == 1
    assert cpu.decode.bundles() == [{"CPU": 1.0}] and (cpu.gateway.host, cpu.gateway.port) == ("127.0.0.1", 8000)
    assert gpu.prefill.replicas + gpu.decode.replicas == 8
    assert gpu.decode.bundles() == [{"CPU": 4.0, "GPU": 1.0}] and gpu.gateway.host == "0.0.0.0"
    assert multi.prefill.bundles()[0]["prefill"] == 1 and multi.decode.bundles()[0]["decode"] == 1


def test_empty_file_and_empty_sections_are_the_defaults(tmp_path):
    assert load(tmp_path, "") == DeployConfig()
    assert load(tmp_path, "# only comments\n") == DeployConfig()
    assert load(tmp_path, "decode:\n  # replicas: 2\n") == DeployConfig()
    config = DeployConfig()
    assert (config.model, config.dtype, config.served_name) == ("smollm2", "auto", None)
    assert config.prefill == config.decode == PoolConfig()
    assert config.gateway == GatewaySettings()
    assert (config.health_interval_s, config.health_timeout_s, config.unhealthy_after) == (2.0, 10.0, 3)
    assert (config.drain_timeout_s, config.ready_timeout_s) == (600.0, 300.0)


def test_round_trip_keeps_every_field(tmp_path):
    config = load(tmp_path, """
model: /models/m
served_name: m
dtype: float32
prefill: {replicas: 0, kv_blocks: 100, resources: {prefill: 1}, extra_args: [--push-timeout, "5"]}
decode: {replicas: 3, num_gpus: 0.5, max_num_seqs: 8}
gateway: {host: 0.0.0.0, port: 0, tenants: t.json, max_ttft_s: null, max_output_tokens: 16}
unhealthy_after: 5
""")
    data = config.to_dict()
    assert data["prefill"]["resources"] == {"prefill": 1.0} and data["gateway"]["max_ttft_s"] is None
    assert DeployConfig.from_dict(data) == config
    data["decode"]["replicas"] = 7  # to_dict hands out a copy
    assert config.decode.replicas == 3


def test_integers_are_accepted_for_numbers_and_stored_as_floats(tmp_path):
    config = load(tmp_path, "decode: {num_cpus: 2, kv_memory_gib: 3}\nhealth_interval_s: 1\n")
    assert config.decode.num_cpus == 2.0 and isinstance(config.decode.num_cpus, float)
    assert isinstance(config.decode.kv_memory_gib, float) and isinstance(config.health_interval_s, float)


@pytest.mark.parametrize("text,message", [
    ("decode:\n  replicsa: 2\n", "x.yaml: decode.replicsa: unknown key (did you mean 'replicas'?)"),
    ("modle: m\n", "x.yaml: modle: unknown key (did you mean 'model'?)"),
    ("gateway: {prot: 80}\n", "x.yaml: gateway.prot: unknown key (did you mean 'port'?)"),
    ("zzz: 1\n", "x.yaml: zzz: unknown key (known keys: model, served_name, dtype, prefill, decode"),
])
def test_unknown_keys_are_named_with_their_path_and_close_matches(tmp_path, text, message):
    with pytest.raises(ConfigError) as e:
        load(tmp_path, text)
    assert str(e.value).startswith(str(tmp_path / "x.yaml")) and message in str(e.value)


@pytest.mark.parametrize("text,message", [
    ("decode:\n  replicas: two\n", "decode.replicas: expected an integer, got 'two'"),
    ("decode: {replicas: 2.0}\n", "decode.replicas: expected an integer, got 2.0"),
    ("decode: {replicas: true}\n", "decode.replicas: expected an integer, got True"),
    ("prefill: {num_cpus: true}\n", "prefill.num_cpus: expected a number, got True"),
    ("prefill: {num_cpus: '1'}\n", "prefill.num_cpus: expected a number, got '1'"),
    ("model: 7\n", "model: expected a string, got 7"),
    ("prefill: {extra_args: [--push-timeout, 5]}\n", "prefill.extra_args[1]: expected a string, got 5"),
    ("prefill: {extra_args: --x}\n", "prefill.extra_args: expected a list, got '--x'"),
    ("decode: {resources: {decode: lots}}\n", "decode.resources.decode: expected a number, got 'lots'"),
    ("decode: 2\n", "decode: expected a mapping of keys, got int 2"),
    ("- model: m\n", "expected a mapping of keys, got list"),
    ("gateway: {port: null}\n", "gateway.port: expected an integer, got None"),
])
def test_wrong_types_say_what_was_expected(tmp_path, text, message):
    with pytest.raises(ConfigError, match="^" + re.escape(str(tmp_path / "x.yaml"))) as e:
        load(tmp_path, text)
    assert message in str(e.value)


@pytest.mark.parametrize("text,message", [
    ("decode: {replicas: 0}\n", "decode.replicas: must be at least 1"),
    ("prefill: {replicas: -1}\n", "prefill.replicas: must be at least 0, got -1"),
    ("prefill: {num_cpus: -0.5}\n", "prefill.num_cpus: must be at least 0, got -0.5"),
    ("decode: {kv_memory_gib: 0}\n", "decode.kv_memory_gib: must be more than 0, got 0.0"),
    ("decode: {kv_blocks: 0}\n", "decode.kv_blocks: must be at least 1, got 0"),
    ("decode: {threads: 0}\n", "decode.threads: must be at least 1, got 0"),
    ("decode: {resources: {GPU: 1}}\n", "decode.resources.GPU: use num_cpus / num_gpus instead"),
    ("gateway: {port: 70000}\n", "gateway.port: must be in 0..65535, got 70000"),
    ("gateway: {max_ttft_s: 0}\n", "gateway.max_ttft_s: must be more than 0"),
    ("gateway: {processes: 0}\n", "gateway.processes: must be at least 1, got 0"),
    ("gateway: {decode_streams: batched}\n", "gateway.decode_streams: must be worker or request, got 'batched'"),
    ("dtype: fp8\n", "dtype: must be one of auto, bfloat16, float32, float16, got 'fp8'"),
    ("unhealthy_after: 0\n", "unhealthy_after: must be at least 1, got 0"),
    ("health_interval_s: 0\n", "health_interval_s: must be more than 0"),
])
def test_out_of_range_values_are_refused(tmp_path, text, message):
    with pytest.raises(ConfigError, match="^" + re.escape(str(tmp_path / "x.yaml"))) as e:
        load(tmp_path, text)
    assert message in str(e.value)


def test_each_pool_takes_its_own_tensor_parallel_degree(tmp_path):
    config = load(tmp_path, "prefill: {tp_size: 2}\ndecode: {tp_size: 4}\n")
    assert (config.prefill.tp_size, config.decode.tp_size) == (2, 4)
    with pytest.raises(ConfigError, match=r"decode\.tp_size: must be at least 1, got 0"):
        load(tmp_path, "decode: {tp_size: 0}\n")


def test_missing_file_and_bad_yaml_are_clear(tmp_path):
    with pytest.raises(ConfigError, match=r"nope\.yaml: cannot read the config file: No such file"):
        DeployConfig.from_yaml(tmp_path / "nope.yaml")
    with pytest.raises(ConfigError, match=r"x\.yaml: invalid YAML \(line 2, column 1\): found character '\\t'"):
        load(tmp_path, "decode:\n\treplicas: 1\n")
    with pytest.raises(ConfigError, match=r"x\.yaml: invalid YAML \(line 3, column 12\): mapping values are not"):
        load(tmp_path, "decode:\n  replicas: 1\n   num_cpus: 2\n")


def test_from_dict_names_its_source():
    with pytest.raises(ConfigError, match=r"^<config>: decode\.replicas: must be at least 1"):
        DeployConfig.from_dict({"decode": {"replicas": 0}})
    with pytest.raises(ConfigError, match=r"^actor: port: unknown key"):
        DeployConfig.from_dict({"port": 1}, "actor")


def test_worker_args_match_the_worker_flags():
    pool = PoolConfig(threads=2, max_num_batched_tokens=128, max_num_seqs=8, max_waiting=16,
                      extra_args=["--local-prefill-threshold", "32"])
    assert pool.worker_args() == ["--kv-memory-gib", "1.0", "--threads", "2", "--max-num-batched-tokens", "128",
                                  "--max-num-seqs", "8", "--max-waiting", "16", "--stall-timeout", "10.0",
                                  "--local-prefill-threshold", "32"]
    assert PoolConfig(kv_blocks=64).worker_args()[:2] == ["--kv-blocks", "64"]
    assert "--kv-memory-gib" not in PoolConfig(kv_blocks=64).worker_args()


def test_worker_args_parse_with_the_workers_own_parser():
    """The flags must be ones `python -m decode` accepts (checked in a subprocess: it imports torch)."""
    pool = PoolConfig(kv_blocks=64, threads=2, extra_args=["--local-prefill-threshold", "32"])
    code = ("import sys; from worker.process import worker_arguments; p = worker_arguments('decode');"
            "p.add_argument('--local-prefill-threshold', type=int);"
            "a = p.parse_args(['--port', '0', *sys.argv[1:]]);"
            "print(a.kv_blocks, a.threads, a.local_prefill_threshold)")
    out = subprocess.run([sys.executable, "-c", code, *pool.worker_args()], capture_output=True, text=True,
                         cwd=ROOT, check=True).stdout
    assert out.split() == ["64", "2", "32"]


def test_bundles_reserve_what_the_pool_asks_one_per_rank():
    assert PoolConfig().bundles() == [{"CPU": 1.0}]
    assert PoolConfig(num_cpus=4, num_gpus=1, resources={"prefill": 1}).bundles() == \
        [{"CPU": 4, "GPU": 1, "prefill": 1}]
    assert "GPU" not in PoolConfig(num_gpus=0).bundles()[0]
    tp = PoolConfig(num_cpus=2, num_gpus=1, resources={"decode": 1}, tp_size=3)
    assert tp.bundles() == [{"CPU": 2, "GPU": 1, "decode": 1}, {"CPU": 2, "GPU": 1}, {"CPU": 2, "GPU": 1}]
    assert tp.cpus_per_worker == 6
    args = tp.worker_args()
    assert args[args.index("--tensor-parallel-size") + 1] == "3" and "--no-transfer" not in args
    assert "--tensor-parallel-size" not in PoolConfig().worker_args()


def test_gateway_args_only_name_what_is_set():
    assert GatewaySettings().args() == ["--host", "127.0.0.1", "--port", "8000", "--max-ttft", "60.0",
                                        "--max-body-bytes", "1048576"]
    full = GatewaySettings(host="0.0.0.0", port=80, tenants="t.json", max_ttft_s=None, max_output_tokens=64,
                           max_prompt_tokens=4000, max_body_bytes=4096, request_timeout_s=900.0, processes=2,
                           decode_streams="request", response_store_bytes=1 << 30, response_store_ttl_s=600.0,
                           body_timeout_s=8.0, header_timeout_s=5.0)
    assert full.args() == ["--host", "0.0.0.0", "--port", "80", "--tenants", "t.json", "--max-ttft", "inf",
                           "--max-output-tokens", "64", "--max-prompt-tokens", "4000", "--request-timeout", "900.0",
                           "--processes", "2", "--decode-streams", "request", "--response-store-bytes", "1073741824",
                           "--response-store-ttl", "600.0", "--body-timeout", "8.0", "--header-timeout", "5.0",
                           "--max-body-bytes", "4096"]
    off = GatewaySettings(response_store_bytes=0).args()  # 0 is a setting (none stored), not "unset"
    assert off[off.index("--response-store-bytes") + 1] == "0" and "--response-store-ttl" not in off


def test_the_response_store_bounds_come_from_yaml_and_are_checked(tmp_path):
    """`gateway:` in the YAML sets the stored responses' bounds, passed to the gateway as its
    flags; a bound out of range is named."""
    path = tmp_path / "deploy.yaml"
    path.write_text("gateway: {processes: 2, response_store_bytes: 1048576, response_store_ttl_s: 90}\n")
    gateway = DeployConfig.from_yaml(path).gateway
    assert (gateway.response_store_bytes, gateway.response_store_ttl_s) == (1048576, 90)
    args = gateway.args()
    assert args[args.index("--response-store-bytes") + 1] == "1048576"
    assert args[args.index("--response-store-ttl") + 1] == "90.0"
    with pytest.raises(ConfigError, match=r"gateway\.response_store_bytes: must be at least 0, got -1"):
        DeployConfig.from_dict({"gateway": {"response_store_bytes": -1}})
    with pytest.raises(ConfigError, match=r"gateway\.response_store_ttl_s: must be more than 0, got 0"):
        DeployConfig.from_dict({"gateway": {"response_store_ttl_s": 0}})


@pytest.mark.parametrize("host", ["0.0.0.0", "10.1.2.3", "::", "gateway.internal"])
def test_an_open_gateway_off_loopback_is_refused_unless_the_risk_is_accepted(host):
    with pytest.raises(ConfigError, match=r"gateway\.host: .* with no tenants file would serve anyone"):
        DeployConfig().with_overrides(host=host)
    keyed = DeployConfig().with_overrides(host=host, tenants="t.json")
    assert "--insecure-no-api-keys" not in keyed.gateway.args()
    accepted = DeployConfig.from_dict({"gateway": {"host": host, "insecure_no_api_keys": True}})
    assert "--insecure-no-api-keys" in accepted.gateway.args()
    for loopback in ("127.0.0.1", "127.0.0.2", "::1", "localhost"):
        assert DeployConfig().with_overrides(host=loopback).gateway.host == loopback  # local use stays open


def test_overrides_make_a_new_validated_config():
    base = DeployConfig()
    new = base.with_overrides(model="/models/m", prefill_replicas=0, decode_replicas=4, host="0.0.0.0", tenants="t.json",
                              port=9000, decode_kv_memory_gib=8, dtype=None)
    assert (new.model, new.prefill.replicas, new.decode.replicas) == ("/models/m", 0, 4)
    assert (new.gateway.host, new.gateway.port, new.decode.kv_memory_gib) == ("0.0.0.0", 9000, 8.0)
    assert new.dtype == "auto" and base == DeployConfig()  # None means "not given"; base unchanged
    assert base.with_overrides() == base
    with pytest.raises(ConfigError, match=r"^overrides: decode\.replicas: must be at least 1"):
        base.with_overrides(decode_replicas=0)
    with pytest.raises(ConfigError, match=r"^overrides: gateway\.port: expected an integer, got '80'"):
        base.with_overrides(port="80")
    with pytest.raises(ConfigError, match=r"^overrides: decode\.replicsa: unknown key \(did you mean 'replicas'\?\)"):
        base.with_overrides(decode_replicsa=2)


def test_the_module_imports_neither_torch_nor_ray():
    code = "import sys, deploy.config; print(sorted({'torch', 'ray'} & set(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=ROOT, check=True).stdout
    assert out.strip() == "[]"


def test_serve_flags_turn_prefix_routing_off_and_the_disk_tier_on_for_both_pools():
    new = DeployConfig().with_overrides(prefix_routing=False, prefill_kv_disk_dir="/tier", decode_kv_disk_dir="/tier",
                                        decode_kv_disk_gib=2.0)
    assert "--no-prefix-routing" in new.gateway.args()
    assert "--no-prefix-routing" not in DeployConfig().gateway.args()
    assert new.prefill.kv_disk_dir == new.decode.kv_disk_dir == "/tier"
    args = new.decode.worker_args()
    assert args[args.index("--kv-disk-gib") + 1] == "2.0"


def test_internal_tls_takes_yaml_s_on_and_off_and_refuses_anything_else():
    import yaml

    cases = (("internal_tls: on", "on"), ("internal_tls: off", "off"), ("internal_tls: auto", "auto"), ("", "auto"))
    for text, want in cases:
        assert DeployConfig.from_dict(yaml.safe_load(text) or {}).internal_tls == want, text
    with pytest.raises(ConfigError, match="internal_tls: must be auto, on or off"):
        DeployConfig.from_dict({"internal_tls": "maybe"})
