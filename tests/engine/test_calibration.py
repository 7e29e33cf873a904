"""Issue 27, item 2: a cost model that is right from the first request.

At start the engine measures one prefill chunk and one decode step of its real model in its real
paged pool (engine/calibration.py), and, with a remote tier, probes the real store's link
(storage/remote/link_probe.py): the first hit from every tier is planned from figures
("predicted"), never loaded blind ("no figures"). A real tiny engine, real LMDB, a real valkey.
"""
from __future__ import annotations

from engine.calibration import CALIBRATION_TOKENS
from engine.model import model_from_config
from storage.config import CacheConfig
from storage.remote.link_probe import PROBE_NAMESPACE
from service.metrics import ServiceMetrics
from tests.engine.conftest import make_engine, random_prompt, reference_greedy, tiny_llama_config
from tests.engine.test_async_restore import to_disk_only
from tieredkv import Engine, SamplingParams

BS = 4
GREEDY = SamplingParams(max_tokens=3)


def test_the_engine_is_fitted_at_start_and_plans_its_first_hits(tmp_path) -> None:
    prompt = random_prompt(12 * BS + 3, seed=31)
    expected = reference_greedy(None, prompt, GREEDY.max_tokens)
    with make_engine(tmp_path, exact_hits=False) as eng:
        # Before any request: fitted, from one chunk and one decode step of the real model...
        pre = eng.cache_status()["cost_model"]["prefill"]
        assert pre["fitted"] and pre["prefill_2048_s"] > 0
        assert pre["calibration"]["prefill_tokens"] == CALIBRATION_TOKENS
        assert pre["calibration"]["decode_context"] == CALIBRATION_TOKENS + 1
        assert eng.planner.compute_seconds(0, 1) is not None
        # ...whose pages went back to the pool unregistered: nothing cached, nothing billed.
        device = eng.cache.stats()["device"]
        assert device.blocks == 0 and eng.cache.pool.num_free == eng.cache.pool.num_pages
        assert eng.ledger.tenants() == []
        assert eng.generate(prompt, GREEDY).token_ids == expected
        eng.demote("device")
        host_hit = eng.generate(prompt, GREEDY)                     # the first host hit
        to_disk_only(eng)
        disk_hit = eng.generate(prompt, GREEDY)                     # the first disk hit
        cost = eng.cache_status()["cost_model"]
        metrics = ServiceMetrics(eng.cache_status, lambda: 0).render().decode()
    planner = cost["planner"]
    assert host_hit.token_ids == disk_hit.token_ids == expected
    assert host_hit.usage.hit_tokens_by_tier["host"] == 12 * BS
    assert disk_hit.usage.hit_tokens_by_tier["disk"] == 12 * BS
    # Both planned from figures, whichever way each went (load, split or recompute).
    assert planner["reasons"] == {"policy": 0, "no figures": 0, "predicted": 2}
    assert sum(planner["decisions"].values()) == 2
    # The cost model's error is tracked from the first request: its prefill steps were predicted
    # (the calibration's fit) and then observed; status and /metrics show it.
    assert cost["prefill"]["recent"] and all(p["predicted_s"] > 0 and p["observed_s"] > 0
                                             for p in cost["prefill"]["recent"])
    assert 'tieredkv_cost_model_error_ratio{part="prefill"}' in metrics
    assert 'tieredkv_restore_latency_seconds{tier="host"}' in metrics


def test_without_calibration_the_first_hit_loads_with_no_figures(tmp_path) -> None:
    prompt = random_prompt(12 * BS + 3, seed=32)
    with make_engine(tmp_path, calibrate=False, exact_hits=False) as eng:
        assert not eng.cache_status()["cost_model"]["prefill"]["fitted"]
        first = eng.generate(prompt, GREEDY)
        to_disk_only(eng)
        before = eng.cache.stats()["disk"].promotions
        again = eng.generate(prompt, GREEDY)
        planner = eng.cache_status()["cost_model"]["planner"]
        promoted = eng.cache.stats()["disk"].promotions - before
    assert again.token_ids == first.token_ids
    assert planner["reasons"]["no figures"] == 1 and planner["decisions"]["load"] == 1
    assert promoted == 12 and again.metrics.recomputed_hit_tokens == 0


def test_the_remote_tiers_first_figure_is_the_links(tmp_path, valkey) -> None:
    cache = CacheConfig(block_size=BS, device_memory="256KiB", host_memory="256KiB", disk_dir=str(tmp_path / "kv"),
                        disk_capacity="64MiB", remote_url=valkey.url)
    with Engine(model_from_config(tiny_llama_config(), seed=0), cache, exact_hits=False) as eng:
        assert eng.link_calibration.join(timeout=60)
        rates = eng.cache_status()["cost_model"]["restore_bytes_per_s"]
        remote = eng.cache.remote
        stats = remote.stats()
        leftovers = remote._client().keys(b"tkv:r2:" + PROBE_NAMESPACE.hex().encode() + b":*")
    figures = eng.link_calibration.figures
    assert figures is not None and figures.rtt_s > 0 and figures.read_s > 0   # (no order: a busy machine can make a read faster than a round trip)
    assert figures.value_bytes > 0 and figures.block_bytes == eng.layout.nbytes
    assert rates["remote"]["source"] == "link probe" and rates["remote"]["samples"] == 0
    assert rates["remote"]["latency_s"] > 0 and rates["remote"]["bytes_per_s"] > 0
    # The probe's value was read back and deleted; no block was counted as hit or written.
    assert leftovers == []
    assert (stats.store_hits, stats.misses, stats.writes, stats.errors, stats.corrupt) == (0, 0, 0, 0, 0)
