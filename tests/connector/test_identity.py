"""Issue #19: the store identity covers the model's contents (sampled, not
only stat) and vLLM's resolved settings, identically on every side and
every start."""

from __future__ import annotations

import json
import os
import pickle
import shutil
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest

from kvtier.connector.identity import (
    HASH_FIX,
    ModelSource,
    model_identity,
    prefix_hash_problem,
    sampled_digest,
    settings_digest,
    settings_identity,
    weights_change_at_runtime,
)
from kvtier.testing.model import build_tiny_llama

_DIGEST_CHILD = """
import os, sys
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
from vllm.engine.arg_utils import EngineArgs
from kvtier.connector.identity import settings_digest, settings_identity
cfg = EngineArgs(model=sys.argv[1], dtype="float32", block_size=32).create_engine_config()
print("DIGEST", settings_digest(settings_identity(cfg)))
"""


def _config(model: str, dtype: str = "float32", **kw):
    from vllm.engine.arg_utils import EngineArgs

    return EngineArgs(
        model=model, dtype=dtype, block_size=32, **kw
    ).create_engine_config()


@pytest.fixture(scope="module")
def model() -> str:
    return build_tiny_llama()


def test_settings_survive_the_trip_to_a_worker(model) -> None:
    """Workers get the VllmConfig pickled: their identity must be the
    scheduler's, or every disk lookup would miss."""
    cfg = _config(model)
    assert settings_identity(pickle.loads(pickle.dumps(cfg))) == settings_identity(cfg)


_MODEL_INIT_CHILD = """
import os, pickle, sys
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
from vllm.config import set_current_vllm_config
from vllm.distributed import init_distributed_environment, initialize_model_parallel
from vllm.engine.arg_utils import EngineArgs
from vllm.model_executor.model_loader.utils import initialize_model
from kvtier.connector.identity import settings_digest, settings_identity
cfg = EngineArgs(
    model=sys.argv[1], dtype="float32", block_size=32, max_model_len=2048,
    load_format="dummy", skip_tokenizer_init=True,
).create_engine_config()
print("SCHEDULER", settings_digest(settings_identity(cfg)))
worker = pickle.loads(pickle.dumps(cfg))  # as vLLM's MultiprocExecutor hands it
with set_current_vllm_config(worker):
    init_distributed_environment(
        world_size=1, rank=0, local_rank=0, backend="gloo",
        distributed_init_method="tcp://127.0.0.1:" + sys.argv[2],
    )
    initialize_model_parallel(1, 1)
    model = initialize_model(vllm_config=worker)
print("WORKER", settings_digest(settings_identity(worker)))
print("TUNING", cfg.model_config.hf_config.attn_temperature_tuning,
      worker.model_config.hf_config.attn_temperature_tuning)
"""


def test_settings_ignore_what_model_code_writes_into_the_config(tmp_path) -> None:
    """Llama4ForCausalLM.__init__ sets hf_config.attn_temperature_tuning in
    the process that builds the model: a worker, under vLLM's multiprocess
    executor (TP > 1), not the scheduler. The scheduler's connector and the
    worker's must still name the same store, or every disk hit is a failed
    read."""
    import socket

    from transformers import Llama4TextConfig

    hf = Llama4TextConfig(
        vocab_size=1024, hidden_size=128, intermediate_size=128,
        intermediate_size_mlp=256, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, num_local_experts=2,
        num_experts_per_tok=1, interleave_moe_layer_step=1,
        max_position_embeddings=4096, attention_chunk_size=8192,
        no_rope_layers=[1, 0],
    )  # fmt: skip
    hf.architectures = ["Llama4ForCausalLM"]
    hf.save_pretrained(tmp_path)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = subprocess.run(
        [sys.executable, "-c", _MODEL_INIT_CHILD, str(tmp_path), str(port)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    said = {ln.split()[0]: ln.split()[1:] for ln in out.stdout.splitlines()}
    # The model class did write into the worker's config (else this test
    # proves nothing) ...
    assert said["TUNING"] == ["True", "False"], out.stdout
    # ... and both sides still agree.
    assert said["SCHEDULER"] == said["WORKER"], out.stdout


def test_settings_are_the_same_in_every_process(model) -> None:
    digests = set()
    for seed in ("0", "12345"):
        out = subprocess.run(
            [sys.executable, "-c", _DIGEST_CHILD, model],
            env={**os.environ, "PYTHONHASHSEED": seed},
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert out.returncode == 0, out.stderr[-2000:]
        digests |= {
            ln.split()[1] for ln in out.stdout.splitlines() if ln.startswith("DIGEST")
        }
    assert digests == {settings_digest(settings_identity(_config(model)))}


@pytest.mark.parametrize(
    "change",
    [
        {"hf_overrides": {"rms_norm_eps": 0.5}},
        {
            "hf_overrides": {
                "rope_parameters": {"rope_type": "default", "rope_theta": 5e5}
            }
        },
        {"dtype": "bfloat16"},
        {"kv_cache_dtype": "fp8_e5m2"},
        {"revision": "other"},
        {"attention_config": {"indexer_kv_dtype": "bf16"}},
    ],
    ids=["rms_norm_eps", "rope", "dtype", "kv_cache_dtype", "revision", "indexer"],
)
def test_each_kv_changing_setting_changes_the_identity(model, change) -> None:
    base = settings_identity(_config(model))
    cfg = _config(model, **change)
    assert settings_digest(settings_identity(cfg)) != settings_digest(base)


def test_dummy_weights_are_not_the_checkpoint(model) -> None:
    """--load-format dummy (profiling, benchmarks) runs random weights over
    the same model directory: its KV must never be served to the real
    weights after a restart on the same disk_path, nor theirs to it."""
    base = settings_digest(settings_identity(_config(model)))
    dummy = settings_identity(_config(model, load_format="dummy"))
    assert settings_digest(dummy) != base
    tensorizer = _config(
        model,
        load_format="tensorizer",
        model_loader_extra_config={"tensorizer_uri": "/weights/other.tensors"},
    )
    assert settings_digest(settings_identity(tensorizer)) not in (
        base,
        settings_digest(dummy),
    )
    # Where the same bytes are read from, and how, is not a new store.
    moved = _config(model, download_dir="/tmp/elsewhere", use_tqdm_on_load=False)
    assert settings_digest(settings_identity(moved)) == base


_HUB_CHILD = """
import dataclasses, json, os, sys
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
from vllm.engine.arg_utils import EngineArgs
from kvtier.connector.spec import ConnectorFacts, TieredOffloadingSpec
from kvtier.store.slabs import store_dirname
from kvtier.store.store import DiskStore
from kvtier.testing.offloading import offloading_config
repo, disk = sys.argv[1], sys.argv[3]
out = {}
for name, kw in json.loads(sys.argv[2]).items():
    cfg = EngineArgs(model=repo, dtype="float32", block_size=32, **kw)
    cfg = cfg.create_engine_config()
    # Offline, vLLM resolves a hub id to its snapshot's path first (a local
    # directory, named by its contents); online, the id stays, as here.
    assert "/snapshots/" in cfg.model_config.model
    cfg.model_config.model = repo
    # What kvtier's connector hands its spec, and the store it then opens.
    facts = ConnectorFacts.of(cfg, 1)
    assert facts.concurrent_batches == cfg.max_concurrent_batches >= 1
    assert facts.model_runner_v2 is cfg.use_v2_model_runner
    extra = {
        "spec_name": "TieredOffloadingSpec",
        "spec_module_path": "kvtier.connector",
        "cpu_bytes_to_use": 1 << 20,
        "disk_bytes_to_use": 1 << 20,
        "disk_path": disk,
        "disk_io": "posix",
    }
    config = offloading_config(
        extra, worker_kv_bytes_per_block=4096, model=repo, dtype="float32"
    )
    fp = TieredOffloadingSpec(config, facts).fingerprints[0]
    with DiskStore([disk], 4, fp.block_bytes, fp, backend="posix"):
        pass
    out[name] = {
        "weights": facts.settings["weights"],
        "contents": dict(fp.identity)["contents"],
        "store": store_dirname(fp),
    }
print("WEIGHTS", json.dumps(out))
"""


def _hub_snapshot(hub: Path, repo: str, ref: str, sha: str, model: str) -> None:
    """``model``'s files as the Hugging Face cache keeps ``repo`` at commit
    ``sha``, with branch ``ref`` pointing at it; each commit's
    ``config.json`` is its own (so are its contents)."""
    root = hub / ("models--" + repo.replace("/", "--"))
    snapshot = root / "snapshots" / sha
    shutil.copytree(model, snapshot)
    config = json.loads((snapshot / "config.json").read_text())
    (snapshot / "config.json").write_text(json.dumps({**config, "commit": sha}))
    (root / "refs").mkdir(parents=True, exist_ok=True)
    (root / "refs" / ref).write_text(sha)


def _doctor_stores(env: dict, disk: Path, shm: Path, *more: str) -> dict[str, str]:
    """``kvtier doctor``'s verdict ("adopted" / "set aside") on each store
    under ``disk``, by store directory name."""
    out = subprocess.run(
        [sys.executable, "-m", "kvtier.tools.cli", "doctor", "--json",
         "--disk-path", str(disk), "--cpu-bytes", "1MiB", "--disk-bytes", "1MiB",
         "--shm-dir", str(shm), "--no-probe", *more],
        env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert out.returncode in (0, 1), out.stderr[-3000:]
    return {
        c["subject"].removeprefix("store "): c["detail"].split(":")[0]
        for c in json.loads(out.stdout)["checks"]
        if c["subject"].startswith("store kvtier-")
    }


def test_a_hub_model_is_named_by_the_snapshot_its_revision_and_cache_resolve_to(
    model, tmp_path
) -> None:
    """A hub id is served from the snapshot its ``revision`` (a branch that
    can move) resolves to in its cache, ``download_dir`` if given: that
    snapshot's commit is in the identity, and so are that snapshot's
    contents (not main's in the hub's own cache), so a branch moved to new
    weights, another branch or another cache's copy is another store.
    ``kvtier doctor --revision --download-dir`` hashes the same snapshot as
    the engine, so it names the store that engine would adopt."""
    repo, a, b = "kvtier-test/tiny", "a" * 40, "b" * 40
    hub, elsewhere = tmp_path / "hub", tmp_path / "elsewhere"
    _hub_snapshot(hub, repo, "main", a, model)
    _hub_snapshot(hub, repo, "v2", b, model)
    _hub_snapshot(elsewhere, repo, "main", b, model)
    disk, shm = tmp_path / "disk", tmp_path / "shm"
    disk.mkdir(mode=0o700)
    shm.mkdir(mode=0o700)
    cases = {
        "main": {},
        "v2": {"revision": "v2"},
        "download_dir": {"download_dir": str(elsewhere)},
        "transfer": {"weight_transfer_config": {"backend": "nccl"}},
    }
    env = {**os.environ, "HF_HUB_CACHE": str(hub), "HF_HUB_OFFLINE": "1"}
    out = subprocess.run(
        [sys.executable, "-c", _HUB_CHILD, repo, json.dumps(cases), str(disk)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    (line,) = [ln for ln in out.stdout.splitlines() if ln.startswith("WEIGHTS")]
    got = json.loads(line.split(" ", 1)[1])
    assert {name: case["weights"] for name, case in got.items()} == {
        "main": {"snapshot": a, "runtime_updates": "none"},
        "v2": {"snapshot": b, "runtime_updates": "none"},
        "download_dir": {"snapshot": b, "runtime_updates": "none"},
        "transfer": {"snapshot": a, "runtime_updates": "nccl"},
    }
    # The contents hashed are the served snapshot's: commit b's, in either
    # cache, are not main's (and each cache's copy has its own mtimes).
    contents = {name: case["contents"] for name, case in got.items()}
    assert contents["main"] not in (contents["v2"], contents["download_dir"])
    assert contents["transfer"] == contents["main"]
    v2 = ModelSource.resolve(repo, revision="v2", download_dir=str(hub))
    assert contents["v2"] == model_identity(v2, kv_cache_dtype="float32")
    # The doctor, given vllm serve's flags, adopts the store that engine
    # would and sets aside the others' (same name, other contents). (The
    # doctor compares contents only: it cannot tell the transfer engine's.)
    stores = {name: case["store"] for name, case in got.items() if name != "transfer"}
    serve = {
        "main": (),
        "v2": ("--revision", "v2"),
        "download_dir": ("--download-dir", str(elsewhere)),
    }
    adopted = {}
    for case, more in serve.items():
        verdicts = _doctor_stores(env, disk, shm, "--model", repo, *more)
        adopted[case] = {n for n, st in stores.items() if verdicts[st] == "adopted"}
    assert adopted == {
        "main": {"main"},
        "v2": {"v2"},
        "download_dir": {"download_dir"},
    }
    # A local directory is named by its contents (model_identity) instead.
    assert settings_identity(_config(model))["weights"] == {
        "snapshot": "",
        "runtime_updates": "none",
    }


def test_runtime_weight_updates_are_never_adopted(model) -> None:
    """vLLM's weight_transfer_config (a trainer pushes weights into the
    running engine): its own store, and a later engine adopts none of it."""
    base = settings_identity(_config(model))
    rl = settings_identity(_config(model, weight_transfer_config={"backend": "nccl"}))
    assert settings_digest(rl) != settings_digest(base)
    assert weights_change_at_runtime(rl)
    assert not weights_change_at_runtime(base)
    assert not weights_change_at_runtime(None)


_LONGROPE = {
    "rope_parameters": {
        "rope_type": "longrope",
        "rope_theta": 10000.0,
        "short_factor": [1.0] * 16,  # head_dim 32
        "long_factor": [4.0] * 16,
        "original_max_position_embeddings": 1024,
    }
}


def _long_factors(cfg) -> bool:
    """Which factors vLLM's own LongRoPE embedding rotates keys with."""
    import torch
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.layers.rotary_embedding import (
        Phi3LongRoPEScaledRotaryEmbedding,
    )

    rope = cfg.model_config.hf_text_config.rope_parameters
    with set_current_vllm_config(cfg):
        emb = Phi3LongRoPEScaledRotaryEmbedding(
            32,
            32,
            4096,
            rope["original_max_position_embeddings"],
            10000.0,
            True,
            torch.float32,
            rope["short_factor"],
            rope["long_factor"],
        )
    return emb.use_long_rope


def test_longrope_max_model_len_changes_the_identity(model) -> None:
    """max_model_len is KV-neutral but for LongRoPE (Phi-3/3.5/4-mini):
    above original_max_position_embeddings vLLM rotates every key with the
    long factors, at or below it with the short ones."""
    short = _config(model, hf_overrides=_LONGROPE, max_model_len=1024)
    short2 = _config(model, hf_overrides=_LONGROPE, max_model_len=512)
    long = _config(model, hf_overrides=_LONGROPE, max_model_len=4096)
    long2 = _config(model, hf_overrides=_LONGROPE, max_model_len=2048)
    assert not _long_factors(short) and _long_factors(long)
    digest = [
        settings_digest(settings_identity(c)) for c in (short, short2, long, long2)
    ]
    assert digest[0] != digest[2]
    # Same factors, same KV: no new store.
    assert digest[0] == digest[1] and digest[2] == digest[3]


def test_kv_neutral_settings_keep_the_identity(model) -> None:
    base = settings_digest(settings_identity(_config(model)))
    assert (
        settings_digest(settings_identity(_config(model, max_model_len=1024, seed=7)))
        == base
    )


def _draft(draft: str, **kw) -> dict:
    return {
        "method": "draft_model",
        "model": draft,
        "num_speculative_tokens": 2,
        **kw,
    }


def test_the_draft_model_is_in_the_identity(model, tmp_path) -> None:
    """Speculative decoding's draft layers (draft_model, EAGLE, MTP) keep
    their KV in the target's blocks, under the same block hashes, and are
    offloaded with them; another draft of the same shape leaves the
    geometry as it was. A restart with another draft, a draft rewritten in
    place or another draft KV dtype must not serve the old draft's KV."""
    digest = lambda **kw: settings_digest(settings_identity(_config(model, **kw)))  # noqa: E731
    draft = tmp_path / "draft"
    shutil.copytree(build_tiny_llama(seed=1), draft)
    base = digest()
    first = digest(speculative_config=_draft(str(draft)))
    other = digest(speculative_config=_draft(build_tiny_llama(seed=2)))
    fp8 = digest(speculative_config=_draft(str(draft), kv_cache_dtype="fp8_e5m2"))
    assert len({base, first, other, fp8}) == 4
    # The same draft rewritten in place (another fine-tune, same shapes).
    weights = next(draft.glob("*.safetensors"))
    weights.write_bytes(
        next(Path(build_tiny_llama(seed=2)).glob("*.safetensors")).read_bytes()
    )
    assert digest(speculative_config=_draft(str(draft))) not in (first, other)
    # Workers get the config pickled: their identity is the scheduler's.
    cfg = _config(model, speculative_config=_draft(str(draft)))
    assert settings_identity(pickle.loads(pickle.dumps(cfg))) == settings_identity(cfg)
    # What cannot change a draft KV value keeps the store: how many tokens
    # it proposes, and proposers with no layers (n-gram).
    assert digest(speculative_config=_draft(str(draft), num_speculative_tokens=3)) == (
        settings_digest(settings_identity(cfg))
    )
    ngram = {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 3}
    assert digest(speculative_config=ngram) == base


def test_a_same_size_same_mtime_rewrite_changes_the_model_identity(tmp_path) -> None:
    src = Path(build_tiny_llama())
    mdir = tmp_path / "m"
    shutil.copytree(src, mdir, copy_function=shutil.copy2)
    first = model_identity(str(mdir))
    weights = next(mdir.glob("*.safetensors"))
    st = weights.stat()
    data = bytearray(weights.read_bytes())
    data[-100] ^= 0xFF  # one byte in the last sample window
    weights.write_bytes(bytes(data))
    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert weights.stat().st_size == st.st_size
    assert weights.stat().st_mtime_ns == st.st_mtime_ns
    assert model_identity(str(mdir)) != first


def test_sampled_digest_reads_the_safetensors_header(tmp_path) -> None:
    """The header names every tensor's dtype, shape and offsets: a change
    there changes the digest even where no sample lands."""
    body = b"\0" * (1 << 20)
    a, b = tmp_path / "a.safetensors", tmp_path / "b.safetensors"
    for path, name in ((a, b'{"x":1}'), (b, b'{"y":1}')):
        path.write_bytes(len(name).to_bytes(8, "little") + name + body)
    assert sampled_digest(str(a), a.stat().st_size) != sampled_digest(
        str(b), b.stat().st_size
    )


@pytest.mark.parametrize("name", ["model.safetensors", "config.json", "x.index.json"])
def test_a_fifo_in_the_model_directory_does_not_hang(tmp_path, name: str) -> None:
    """Weights are sampled, configs and indexes hashed whole: a FIFO under
    either kind of name is recorded as an error, never a hang."""
    os.mkfifo(tmp_path / name)
    if name.endswith(".safetensors"):
        with pytest.raises(OSError):
            sampled_digest(str(tmp_path / name), 0)
    done: list[Any] = []
    walk = threading.Thread(
        target=lambda: done.append(model_identity(str(tmp_path))), daemon=True
    )
    walk.start()
    walk.join(10)
    if walk.is_alive():  # unblock the open the thread hangs in
        os.close(os.open(tmp_path / name, os.O_WRONLY | os.O_NONBLOCK))
        pytest.fail(f"model_identity hung on a FIFO named {name}")
    assert done and done[0] is not None


def test_prefix_hash_reproducibility() -> None:
    assert prefix_hash_problem("xxhash", None)
    assert prefix_hash_problem("xxhash_cbor", None)
    assert prefix_hash_problem("xxhash", "42") is None
    assert prefix_hash_problem("sha256", None) is None


@pytest.mark.parametrize("algo", ["sha256", "sha256_cbor", "xxhash", "xxhash_cbor"])
@pytest.mark.parametrize("seed", [None, "", "random", "0", "42"])
def test_prefix_hash_problem_follows_vllms_seed_rule(
    monkeypatch: pytest.MonkeyPatch, algo: str, seed: str | None
) -> None:
    """A problem is reported exactly when vLLM's own seed for NONE_HASH
    differs between two processes started alike: ``resolve_none_hash_seed``
    called twice under that environment (an empty or ``random``
    PYTHONHASHSEED is Python's random seed, but vLLM's fixed one)."""
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import resolve_none_hash_seed

    if seed is None:
        monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    else:
        monkeypatch.setenv("PYTHONHASHSEED", seed)
    hash_fn = get_hash_fn_by_name(algo)
    reproducible = resolve_none_hash_seed(hash_fn) == resolve_none_hash_seed(hash_fn)
    assert (prefix_hash_problem(algo, seed) is None) == reproducible
    assert "PYTHONHASHSEED" in HASH_FIX


_LLAMA4_CHILD = r"""
import json, os, sys
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
from vllm.config import set_current_vllm_config
from vllm.distributed import init_distributed_environment, initialize_model_parallel
from vllm.engine.arg_utils import EngineArgs
from vllm.model_executor.model_loader.utils import initialize_model
from kvtier.connector.identity import settings_digest, settings_identity

out = {}
for i, (name, spec) in enumerate(json.loads(sys.argv[2]).items()):
    cfg = EngineArgs(
        model=spec["model"], dtype="float32", block_size=32, load_format="dummy",
        skip_tokenizer_init=True, **spec["kw"],
    ).create_engine_config()
    digest = settings_digest(settings_identity(cfg))
    with set_current_vllm_config(cfg):
        if i == 0:
            init_distributed_environment(
                world_size=1, rank=0, local_rank=0, backend="gloo",
                distributed_init_method="tcp://127.0.0.1:" + sys.argv[1],
            )
            initialize_model_parallel(1, 1)
        m = initialize_model(vllm_config=cfg)
    attn = m.model.layers[1].self_attn  # a NoPE layer (no_rope_layers=[1, 0])
    assert attn.nope
    settings = settings_identity(cfg)  # after the model class wrote its flag
    assert settings_digest(settings) == digest, "a worker would name another store"
    ours = settings["model_factors"]["llama4_attn_temperature_tuning"]
    out[name] = [digest, bool(attn.attn_temperature_tuning), ours]
    del m
print("RESULT", json.dumps(out))
"""


def _tiny_llama4(root: Path, generation: dict | None = None) -> str:
    from transformers import Llama4TextConfig

    hf = Llama4TextConfig(
        vocab_size=1024, hidden_size=128, intermediate_size=128,
        intermediate_size_mlp=256, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, num_local_experts=2,
        num_experts_per_tok=1, interleave_moe_layer_step=1,
        max_position_embeddings=131072, attention_chunk_size=8192,
        no_rope_layers=[1, 0],
    )  # fmt: skip
    hf.architectures = ["Llama4ForCausalLM"]
    hf.save_pretrained(root)
    (root / "generation_config.json").unlink(missing_ok=True)
    if generation is not None:
        (root / "generation_config.json").write_text(json.dumps(generation))
    return str(root)


def test_llama4_temperature_tuning_is_in_the_identity(tmp_path) -> None:
    """Llama 4's model code scales its NoPE layers' queries (so every later
    layer's KV) when generation_config says so, else when max_model_len
    exceeds 32K: settings the identity otherwise leaves out. The identity
    follows vLLM's own decision, read here from the model vLLM builds."""
    import socket

    plain = _tiny_llama4(tmp_path / "plain")
    tuned = _tiny_llama4(tmp_path / "tuned", {"attn_temperature_tuning": True})
    variants = {
        "short": {"model": plain, "kw": {"max_model_len": 8192}},
        "short2": {"model": plain, "kw": {"max_model_len": 16384}},
        "long": {"model": plain, "kw": {"max_model_len": 65536}},
        "override": {
            "model": plain,
            "kw": {
                "max_model_len": 8192,
                "override_generation_config": {"attn_temperature_tuning": True},
            },
        },
        "file": {"model": tuned, "kw": {"max_model_len": 8192}},
    }
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.run(
        [sys.executable, "-c", _LLAMA4_CHILD, str(port), json.dumps(variants)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT"))
    got = json.loads(line.split(" ", 1)[1])
    # The identity's flag is the one vLLM's model code runs with.
    assert all(ours == str(t) for _, t, ours in got.values()), got
    tuning = {name: t for name, (_, t, _) in got.items()}
    assert tuning == {
        "short": False, "short2": False, "long": True, "override": True, "file": True
    }  # fmt: skip
    digest = {name: d for name, (d, _, _) in got.items()}
    assert digest["short"] == digest["short2"]  # same KV: same store
    assert digest["short"] != digest["long"]
    assert digest["long"] == digest["override"]
    assert digest["short"] != digest["override"]


def test_context_parallel_interleave_is_in_the_identity(model) -> None:
    """Under decode context parallelism vLLM's slot mapping puts a block's
    tokens on the ranks by cp_kv_cache_interleave_size: with 2 ranks and 1,
    rank 0 holds the even positions; with 16, positions 0-15, 32-47, ...
    Same sizes, same geometry, other bytes per slot. Without context
    parallelism the identity has no such entry (those stores keep their
    names)."""

    def cfg(interleave: int):
        return _config(
            model,
            tensor_parallel_size=4,  # more ranks than KV heads, as DCP needs
            decode_context_parallel_size=2,
            cp_kv_cache_interleave_size=interleave,
            distributed_executor_backend="mp",
        )

    one, sixteen = settings_identity(cfg(1)), settings_identity(cfg(16))
    assert one["context_parallel"] == {"dcp": 2, "pcp": 1, "interleave": 1}
    assert settings_digest(one) != settings_digest(sixteen)
    assert "context_parallel" not in settings_identity(_config(model))


def test_lora_target_modules_are_in_the_identity(model) -> None:
    """vLLM applies an adapter to the modules --lora-target-modules names
    only, while an adapter's blocks are keyed by its name and path: the
    same adapter gives other KV under another target list."""
    every = settings_identity(_config(model, enable_lora=True))
    o_only = settings_identity(
        _config(model, enable_lora=True, lora_target_modules=["o_proj"])
    )
    assert settings_digest(every) != settings_digest(o_only)
    assert "lora" not in settings_identity(_config(model))
    # vLLM matches modules against the list as a set: its order is no setting.
    two = settings_identity(
        _config(model, enable_lora=True, lora_target_modules=["o_proj", "q_proj"])
    )
    owt = settings_identity(
        _config(model, enable_lora=True, lora_target_modules=["q_proj", "o_proj"])
    )
    assert settings_digest(two) == settings_digest(owt) != settings_digest(o_only)


def test_an_engram_models_tokenizer_is_in_the_identity(tmp_path) -> None:
    """A model with n-gram embedding (Engram) layers builds its token map
    from the tokenizer's strings: another tokenizer, other hidden states
    for the same token ids."""
    (tmp_path / "config.json").write_text(
        json.dumps(
            {
                "architectures": ["DeepseekV41ForCausalLM"],
                "model_type": "deepseek_v41",
                "hidden_size": 256,
                "num_hidden_layers": 2,
                "num_attention_heads": 4,
                "num_key_value_heads": 4,
                "vocab_size": 1024,
                "intermediate_size": 256,
                "engram_layer_ids": [1],
            }
        )
    )
    pytest.importorskip("vllm.config.engram")

    def digest(tokenizer: str) -> str:
        cfg = _config(str(tmp_path), tokenizer=tokenizer, skip_tokenizer_init=True)
        return settings_digest(settings_identity(cfg))

    # Directories that exist: a path that does not is taken for a Hub repo
    # id, refused once an earlier test in the process set HF_HUB_OFFLINE.
    a, b = tmp_path / "tokenizer-a", tmp_path / "tokenizer-b"
    a.mkdir(), b.mkdir()
    assert digest(str(a)) == digest(str(a))
    assert digest(str(a)) != digest(str(b))
