"""The capacity plan: the seed's figures with the defaults, hand sums for other inputs.

Expected values are written as the seed writes them (or as the sum done by hand), never
copied from the calculator's output.
"""

from __future__ import annotations

import json
import math
import re
from io import StringIO
from pathlib import Path

import pytest
import yaml
from django.core.management import CommandError, call_command

from drills.domain.capacity_plan import Scenario, ScenarioError, plan, scenario_keys
from simengine.domain.embedding_perf import EMBEDDING_PROFILES

ROOT = Path(__file__).resolve().parents[2]
SEED_YAML = ROOT / "drills" / "scenarios" / "seed.yaml"
DOCS = ROOT / "docs" / "capacity-plan.md"


def run(*args: str) -> str:
    out = StringIO()
    call_command("capacity_plan", *args, stdout=out)
    return out.getvalue()


def test_plan_reproduces_every_seed_figure_with_the_defaults() -> None:
    p = plan(Scenario()).as_dict()
    # What "concurrent" means: "0.5 s + 300 tokens at 30 per second, about 10.5 s",
    # "10.5 / 40 = 26%: a fleet 4 times smaller".
    assert p["answer_s"] == 10.5
    assert round(p["streaming_fraction"], 2) == 0.26
    assert p["streams_from_logged_in_users"] == pytest.approx(262.5)
    assert round(p["fleet_reduction_if_logged_in"]) == 4
    # Tokens per second: "1,000 x 30 = 30,000 ... 100 requests per second".
    assert p["chat_output_tokens_per_s"] == 30_000
    assert p["chat_requests_per_s"] == 100
    # Replicas, 7B: "83 streams at 30 each", "4 times smaller", "12 replicas".
    assert p["streams_per_replica"] == 83
    assert p["gqa_kv_reduction"] == 4
    assert p["peak_share_per_region"] == 1
    assert p["chat_replicas_per_region"] == 12
    # Prefill: "120,000 prompt tokens per second", "56,000, less than half".
    assert p["prefill_tokens_per_s"] == 120_000
    assert p["prefill_tokens_per_s_uncached"] == pytest.approx(56_000)
    assert p["prefill_uncached_fraction"] < 0.5
    # Replicas, 70B: "60 streams x 20 tokens per second = 1,200 ... 3 replicas".
    assert p["big_output_tokens_per_s"] == 1_200
    assert p["big_replicas_per_region"] == 3
    # Two regions: "24 + 6 x 2 = 36 GPUs", "each region runs at half load".
    assert p["gpus_per_region"] == 12 + 3 * 2
    assert p["gpus_total"] == 36
    assert p["chat_utilisation_normal"] == 0.5
    # Cost: "36 x 2.50 x 720 = 64,800 USD per month", "9 million tokens per hour:
    # 0.28 USD per million when full, 0.56 when half busy".
    assert p["usd_per_month"] == 64_800
    assert p["chat_replica_tokens_per_hour"] == 9_000_000
    assert p["chat_usd_per_million_tokens_full"] == 0.28
    assert p["chat_usd_per_million_tokens_half"] == 0.56
    assert p["chat_usd_per_million_tokens_normal"] == 0.56
    # Routing: "1 time in 12", "about 1 key in 13".
    assert p["round_robin_hit_rate"] == pytest.approx(1 / 12)
    assert p["keys_moved_adding_replica"] == pytest.approx(1 / 13)
    # Cold starts: "4 minutes, ... 28 s, ... 14 s, warm-up 30 s. That is about 5
    # minutes, so plan for 6", "1.05^6 = 1.34", "0.70 x 1.34 = 0.94", "the last two
    # steps, under a minute".
    assert p["cold_start_s"] == 4 * 60 + 28 + 14 + 30
    assert round(p["cold_start_s"] / 60) == 5
    assert p["cold_start_plan_min"] == 6
    assert round(p["load_growth_during_cold_start"], 2) == 1.34
    assert round(p["utilisation_when_capacity_arrives"], 2) == 0.94
    assert p["warm_start_s"] == 14 + 30 < 60
    # Precision: "131,072 bytes per token, so 83 streams of 1,500 tokens hold 16 GB".
    assert p["kv_bytes_per_token"] == 131_072
    assert round(p["kv_gb_at_replica_capacity"]) == 16
    assert p["chat_gb_free_at_capacity"] > 0
    # Capacity per version: "at 800 ... needs 38 replicas, not 12", "5.6 GPUs".
    assert p["chat_replicas_per_region_at_low_capacity"] == 38
    assert p["prefill_gpus"] == pytest.approx(5.6)
    assert p["prefill_gpus_without_cache"] == pytest.approx(12)
    # The seed's one warning: its 12 replicas carry its output, not its prompts.
    assert len(p["warnings"]) == 1
    assert (
        "the output-only plan's 12 replicas per region do not carry"
        in (p["warnings"][0])
    )


def test_plan_reproduces_the_seed_precision_options() -> None:
    options = plan(Scenario()).as_dict()["big_precision_options"]
    # "FP16 weights are 140 GB, leaving 20 GB on 2 GPUs. INT8 weights are 70 GB,
    # leaving 90 GB."
    assert options["fp16"]["weights_gb"] == 140
    assert options["fp16"]["cache_gb_at_fleet_gpus"] == 20
    assert options["int8"]["weights_gb"] == 70
    assert options["int8"]["cache_gb_at_fleet_gpus"] == 90
    # "FP16 needs 4 GPUs per replica ... (320 - 140 = 180 GB)", "INT8 on 2 GPUs leaves
    # 90 GB and halves the cost", "4-bit fits on 1 GPU (80 - 35 = 45 GB)".
    assert (options["fp16"]["gpus_per_replica"], options["fp16"]["cache_gb_left"]) == (
        4,
        320 - 140,
    )
    assert (options["int8"]["gpus_per_replica"], options["int8"]["cache_gb_left"]) == (
        2,
        90,
    )
    assert (options["4bit"]["gpus_per_replica"], options["4bit"]["cache_gb_left"]) == (
        1,
        80 - 35,
    )
    assert options["int8"]["big_gpus_total"] * 2 == options["fp16"]["big_gpus_total"]
    # The 36-GPU total is the INT8 fleet; FP16 would be 2 x (12 + 3 x 4).
    assert options["int8"]["fleet_gpus_total"] == 36
    assert options["fp16"]["fleet_gpus_total"] == 2 * (12 + 3 * 4)


def test_plan_with_a_measured_replica_capacity_of_3000() -> None:
    p = plan(Scenario.from_mapping({"replica_output_tokens_per_s": 3_000})).as_dict()
    assert p["streams_per_replica"] == 100  # 3,000 / 30
    assert p["chat_replicas_per_region"] == 10  # ceil(30,000 / 3,000)
    assert p["gpus_total"] == 32  # 2 x (10 + 3 x 2)
    assert p["usd_per_month"] == 57_600  # 32 x 2.50 x 720
    assert p["chat_replica_tokens_per_hour"] == 10_800_000  # 3,000 x 3,600
    assert p["chat_usd_per_million_tokens_full"] == 0.23  # 2.50 / 10.8 = 0.2315
    assert p["chat_usd_per_million_tokens_half"] == 0.46  # 2.50 / 5.4 = 0.4630
    # 100 streams x 1,500 tokens x 131,072 bytes = 19.66 GB
    assert p["kv_gb_at_replica_capacity"] == pytest.approx(19.6608)
    assert p["round_robin_hit_rate"] == pytest.approx(1 / 10)
    assert p["keys_moved_adding_replica"] == pytest.approx(1 / 11)
    # Nothing about the prompts changed.
    assert p["prefill_tokens_per_s_uncached"] == pytest.approx(56_000)


def test_plan_rounds_streams_down_and_replicas_up() -> None:
    p = plan(Scenario.from_mapping({"replica_output_tokens_per_s": 2_990})).as_dict()
    assert p["streams_per_replica"] == 99  # 2,990 / 30 = 99.7: the 100th runs slow
    assert p["chat_replicas_per_region"] == 11  # 30,000 / 2,990 = 10.03
    # 900 x 1.1 = 990 tokens/s is exactly 3 replicas of 330, though the float
    # quotient is 3.0000000000000004: no fourth replica for rounding dust.
    p = plan(
        Scenario.from_mapping(
            {
                "peak_streams": 900,
                "stream_tokens_per_s": 1.1,
                "replica_output_tokens_per_s": 330,
            }
        )
    ).as_dict()
    assert p["chat_replicas_per_region"] == 3


def test_plan_with_a_gpu_price_of_3_usd() -> None:
    p = plan(Scenario.from_mapping({"gpu_hour_usd": 3})).as_dict()
    assert p["usd_per_month"] == 77_760  # 36 x 3 x 720
    assert p["chat_usd_per_million_tokens_full"] == 0.33  # 3 / 9 = 0.333
    assert p["chat_usd_per_million_tokens_half"] == 0.67  # 3 / 4.5 = 0.667
    assert p["gpus_total"] == 36


def test_plan_with_four_regions_shares_the_peak_among_the_survivors() -> None:
    p = plan(Scenario.from_mapping({"regions": 4})).as_dict()
    # 3 survivors carry the peak: 30,000 / 3 = 10,000 tokens/s per region, exactly 4
    # replicas (no spare from float dust); 1,200 / 3 = 400, exactly 1 70B replica.
    assert p["peak_share_per_region"] == pytest.approx(1 / 3)
    assert p["chat_replicas_per_region"] == 4
    assert p["big_replicas_per_region"] == 1
    assert p["gpus_per_region"] == 4 + 1 * 2
    assert p["gpus_total"] == 4 * 6
    assert p["usd_per_month"] == 43_200  # 24 x 2.50 x 720
    # Normally each region carries a quarter: 7,500 of its 10,000 tokens/s.
    assert p["chat_utilisation_normal"] == 0.75
    assert p["chat_usd_per_million_tokens_normal"] == 0.37  # 2.50 / (9 x 0.75)
    assert p["chat_replicas_per_region_at_low_capacity"] == 13  # ceil(10,000 / 800)


def test_plan_can_size_every_region_for_the_whole_peak() -> None:
    p = plan(Scenario.from_mapping({"regions": 4, "regions_lost": 3})).as_dict()
    assert p["chat_replicas_per_region"] == 12
    assert p["gpus_total"] == 4 * (12 + 3 * 2)
    assert p["chat_utilisation_normal"] == 0.25


def test_plan_for_a_405b_model_in_fp8() -> None:
    p = plan(Scenario.from_mapping({"big_model": {"params_b": 405}})).as_dict()
    options = p["big_precision_options"]
    # FP16: 810 GB; 8 GPUs hold 640 GB, so 16 (a divisor of 64 heads): 1,280 - 810.
    assert options["fp16"]["weights_gb"] == 810
    assert options["fp16"]["gpus_per_replica"] == 16
    assert options["fp16"]["cache_gb_left"] == 470
    # FP8 (1 byte, the int8 row): 405 GB; 8 GPUs: 640 - 405 = 235.
    assert options["int8"]["gpus_per_replica"] == 8
    assert options["int8"]["cache_gb_left"] == 235
    # 4-bit: 202.5 GB; 4 GPUs: 320 - 202.5 = 117.5.
    assert options["4bit"]["gpus_per_replica"] == 4
    assert options["4bit"]["cache_gb_left"] == 117.5
    assert options["int8"]["fleet_gpus_total"] == 2 * (12 + 3 * 8)
    # The fleet's 2 GPUs per 70B replica no longer hold any precision.
    assert options["int8"]["cache_gb_at_fleet_gpus"] == 160 - 405
    assert any("no precision leaves 40 GB" in w for w in p["warnings"])


def test_plan_warns_when_load_outgrows_a_cold_start() -> None:
    p = plan(Scenario.from_mapping({"cold_start.growth_per_minute": 0.10})).as_dict()
    # 1.10^6 = 1.7716; 0.70 x 1.7716 = 1.24 of capacity in use on arrival.
    assert round(p["load_growth_during_cold_start"], 4) == 1.7716
    assert round(p["utilisation_when_capacity_arrives"], 2) == 1.24
    assert any("before a cold replica arrives" in w for w in p["warnings"])


def test_plan_with_a_new_chat_model_shape() -> None:
    # A 13B-like shape: 40 layers, 40 KV heads (no GQA), 26 GB of weights.
    p = plan(
        Scenario.from_mapping(
            {"model": {"layers": 40, "kv_heads": 40, "attention_heads": 40}}
            | {"model.weights_gb": 26}
        )
    ).as_dict()
    assert p["kv_bytes_per_token"] == 2 * 40 * 40 * 128 * 2  # 819,200
    # 83 x 1,500 x 819,200 = 102 GB: more than the GPU has left.
    assert p["kv_gb_at_replica_capacity"] == pytest.approx(101.9904)
    assert p["chat_gb_free_at_capacity"] == pytest.approx(80 - 26 - 101.9904)
    assert p["cold_start_s"] == 240 + 52 + 26 + 30
    assert any("more than one GPU" in w for w in p["warnings"])


def test_scenario_reads_nested_and_dotted_keys_alike() -> None:
    nested = Scenario.from_mapping({"big": {"peak_streams": 80}})
    dotted = Scenario.from_mapping({"big.peak_streams": 80})
    overridden = Scenario().with_overrides(["big.peak_streams=80"])
    assert nested == dotted == overridden
    assert nested.big.peak_streams == 80
    assert nested.overrides() == {"big.peak_streams": 80}
    assert plan(nested)["big_replicas_per_region"] == 4  # ceil(80 x 20 / 400)


def test_seed_yaml_is_the_default_scenario_and_lists_every_key() -> None:
    data = yaml.safe_load(SEED_YAML.read_text())
    assert Scenario.from_mapping(data) == Scenario()
    listed = set()
    for key, value in data.items():
        if isinstance(value, dict):
            listed |= {f"{key}.{sub}" for sub in value}
        else:
            listed.add(key)
    assert listed == set(scenario_keys())


@pytest.mark.parametrize(
    ("mapping", "key", "message"),
    [
        ({"peak_stream": 1}, "peak_stream", "did you mean 'peak_streams'"),
        ({"big": {"gpus": 2}}, "big.gpus", "unknown scenario key"),
        ({"big": 3}, "big", "is a section"),
        ({"regions": -1}, "regions", "greater than 0"),
        ({"regions": 1.5}, "regions", "whole number"),
        ({"stream_tokens_per_s": 0}, "stream_tokens_per_s", "greater than 0"),
        (
            {"replica_output_tokens_per_s": "fast"},
            "replica_output_tokens_per_s",
            "number",
        ),
        ({"gpu_hour_usd": True}, "gpu_hour_usd", "number"),
        ({"gpu_hour_usd": None}, "gpu_hour_usd", "number"),
        ({"prefix_hit_rate": 1.2}, "prefix_hit_rate", "at most 1"),
        ({"model.weights_gb": "inf"}, "model.weights_gb", "finite"),
        ({"cached_prefix_tokens": 1_300}, "cached_prefix_tokens", "prompt_tokens"),
        ({"regions_lost": 2}, "regions_lost", "less than regions"),
        ({"cold_start.load_gb_per_s": 0}, "cold_start.load_gb_per_s", "greater than"),
    ],
)
def test_scenario_rejects_bad_keys_and_values(
    mapping: dict[str, object], key: str, message: str
) -> None:
    with pytest.raises(ScenarioError, match=message) as caught:
        Scenario.from_mapping(mapping)
    assert caught.value.key == key


def test_scenario_accepts_zero_where_nothing_divides_by_it() -> None:
    p = plan(Scenario.from_mapping({"big.peak_streams": 0, "prefix_hit_rate": 0}))
    assert p["big_replicas_per_region"] == 0
    assert p["gpus_total"] == 2 * 12
    assert p["prefill_tokens_per_s_uncached"] == 120_000


def test_scenario_rejects_an_override_without_equals() -> None:
    with pytest.raises(ScenarioError, match="key=value"):
        Scenario().with_overrides(["regions"])


def test_command_json_matches_the_seed() -> None:
    data = json.loads(run("--json"))
    assert data["chat_replicas_per_region"] == 12
    assert data["big_replicas_per_region"] == 3
    assert data["gpus_total"] == 36
    assert data["usd_per_month"] == 64_800
    assert data["big_precision_options"]["int8"]["gpus_per_replica"] == 2
    assert data["scenario"]["replica_output_tokens_per_s"] == 2_500
    assert data["scenario"]["big"]["gpus_per_replica"] == 2


def test_command_table_shows_values_with_units_and_sums() -> None:
    out = run()
    lines = {line.split()[0]: line for line in out.splitlines() if line.strip()}
    assert "12" in lines["chat_replicas_per_region"].split()
    assert "replicas" in lines["chat_replicas_per_region"]
    assert "ceil(30,000 / 2,500)" in lines["chat_replicas_per_region"]
    assert "64,800" in lines["usd_per_month"]
    assert "USD" in lines["usd_per_month"]
    assert "131,072" in lines["kv_bytes_per_token"]
    assert "bytes" in lines["kv_bytes_per_token"]
    assert "0.28" in lines["chat_usd_per_million_tokens_full"]
    assert "USD/M tokens" in lines["chat_usd_per_million_tokens_full"]
    assert "tokens/s" in lines["prefill_tokens_per_s_uncached"]
    assert "56,000" in lines["prefill_tokens_per_s_uncached"]
    assert "Two regions" in out
    assert "int8" in lines


def test_command_set_overrides_recompute_the_plan() -> None:
    data = json.loads(
        run("--json", "--set", "replica_output_tokens_per_s=800", "gpu_hour_usd=3")
    )
    assert data["chat_replicas_per_region"] == 38  # the seed's "38, not 12"
    assert data["gpus_total"] == 2 * (38 + 3 * 2)
    assert data["usd_per_month"] == 2 * (38 + 3 * 2) * 3 * 720
    assert data["scenario"]["gpu_hour_usd"] == 3
    assert "replica_output_tokens_per_s=800" in run(
        "--set", "replica_output_tokens_per_s=800"
    )


def test_command_reads_yaml_and_json_scenarios(tmp_path: Path) -> None:
    yaml_file = tmp_path / "s.yaml"
    yaml_file.write_text("regions: 3\nbig:\n  peak_streams: 0\n")
    json_file = tmp_path / "s.json"
    json_file.write_text(json.dumps({"regions": 3, "big.peak_streams": 0}))
    for path in (yaml_file, json_file):
        data = json.loads(run("--json", "--scenario", str(path)))
        # 2 survivors share 30,000: 15,000 / 2,500 = 6 replicas in each of 3 regions.
        assert data["chat_replicas_per_region"] == 6
        assert data["gpus_total"] == 3 * 6
    # --set wins over the file.
    data = json.loads(run("--json", "--scenario", str(yaml_file), "--set", "regions=2"))
    assert data["chat_replicas_per_region"] == 12


def test_command_seed_yaml_prints_the_default_plan() -> None:
    assert run("--scenario", str(SEED_YAML)) == run()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--set", "peak_stream=3"], "peak_stream"),
        (["--set", "regions=zero"], "regions"),
        (["--set", "message_interval_s=0"], "message_interval_s"),
        (["--set", "big.gpus_per_replica=-2"], "big.gpus_per_replica"),
    ],
)
def test_command_bad_scenario_is_a_command_error(args: list[str], message: str) -> None:
    with pytest.raises(CommandError, match=re.escape(message)):
        run(*args)


def test_command_bad_files_are_command_errors(tmp_path: Path) -> None:
    with pytest.raises(CommandError, match="cannot read"):
        run("--scenario", str(tmp_path / "missing.yaml"))
    listed = tmp_path / "list.yaml"
    listed.write_text("- 1\n- 2\n")
    with pytest.raises(CommandError, match="mapping"):
        run("--scenario", str(listed))
    broken = tmp_path / "broken.json"
    broken.write_text("{regions: 2")
    with pytest.raises(CommandError, match="not valid"):
        run("--scenario", str(broken))
    unknown = tmp_path / "unknown.yaml"
    unknown.write_text("cold_start:\n  boot_s: 3\n")
    with pytest.raises(CommandError, match=re.escape("cold_start.boot_s")):
        run("--scenario", str(unknown))


def test_docs_name_every_key_and_output() -> None:
    text = DOCS.read_text()
    for key in scenario_keys():
        assert f"`{key}`" in text, key
    data = plan(Scenario()).as_dict()
    for name in data:
        assert f"`{name}`" in text, name
    for field_name in data["big_precision_options"]["fp16"]:
        assert f"`{field_name}`" in text, field_name


def test_profile_sets_the_replica_section_and_offload_lowers_the_fleet() -> None:
    out = StringIO()
    call_command("capacity_plan", "--json", stdout=out)
    seed = json.loads(out.getvalue())
    out = StringIO()
    call_command("capacity_plan", "--profile", "h100-8b", "--json", stdout=out)
    h100 = json.loads(out.getvalue())
    assert h100["scenario"]["replica"]["ctok_ms"] == 0.022
    # A faster replica carries the peak on fewer of them.
    assert (
        h100["chat_replicas_per_region_with_prefill"]
        < seed["chat_replicas_per_region_with_prefill"]
    )
    out = StringIO()
    call_command("capacity_plan", "--set", "host_offload_gib=128", "--json", stdout=out)
    offload = json.loads(out.getvalue())
    assert offload["chat_replicas_per_region_with_prefill"] == 12
    assert offload["prefix_hit_rate_expected"] > 0.8 > seed["prefix_hit_rate_expected"]
    assert offload["host_hit_rate_expected"] > 0
    assert offload["usd_per_month_with_prefill"] == 64_800


def test_command_prints_the_embedding_pool_when_the_scenario_has_one() -> None:
    assert "Embedding pool" not in run()
    out = run(
        "--set",
        "embedding.ingest_requests_per_s=60",
        "embedding.replica_input_tokens_per_s=400000",
    )
    lines = {line.split()[0]: line for line in out.splitlines() if line.strip()}
    assert "Embedding pool" in out
    load = 60 * 32 * 256
    replicas = math.ceil(load / (400_000 * 0.7))
    assert f"{load:,}" in lines["embedding_input_tokens_per_s"].split()
    assert str(replicas) in lines["embedding_replicas_per_region"].split()
    assert f"+ {replicas} embedding" in lines["gpus_per_region"]


def test_command_embedding_profile_sets_the_replica_capacity() -> None:
    data = json.loads(
        run(
            "--json",
            "--embedding-profile",
            "cpu-minilm",
            "--set",
            "embedding.search_queries_per_s=50",
        )
    )
    cpu = EMBEDDING_PROFILES["cpu-minilm"]
    capacity = round(cpu.full_batch_tokens_per_s)
    assert data["scenario"]["embedding"]["replica_input_tokens_per_s"] == capacity
    assert data["embedding_replicas_per_region"] == math.ceil(
        50 * 32 / (capacity * 0.7)
    )
