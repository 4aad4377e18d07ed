"""The seam against the installed vLLM, without starting an engine: every internal ``specserve.vllm.seam``
reaches is where it expects (vLLM's runner classes, sampler, scheduler output, engine), also once the sampler
patches are in; a runner class that lost a method fails naming it and vLLM's own version. (The proposer also
checks the runner each engine in the other modules builds.)
"""

from __future__ import annotations

import pytest

from specserve.vllm import patches, seam


def test_the_installed_vllm_has_every_internal_the_seam_reaches():
    seam.check_installed()
    from vllm.v1.worker.cpu_model_runner import CPUModelRunner
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    assert seam.runner_problems(GPUModelRunner) == [] and seam.runner_problems(CPUModelRunner) == []
    assert seam.installed_problems() == []


def test_the_check_reads_vllm_s_own_functions_once_the_patches_replaced_them():
    patches.apply_all()
    patches.allow_in_validation()
    assert {"validate_spec_decode", "build_logitsprocs", "apply_logits_processors", "apply_sampling_constraints"} <= set(seam._originals)
    seam.check_installed()


def test_a_runner_class_that_lost_a_method_is_named_with_vllm_s_version():
    import vllm
    from vllm.v1.worker.cpu_model_runner import CPUModelRunner

    moved = type("CPUModelRunner", (CPUModelRunner,), {"_prepare_inputs": None})
    with pytest.raises(seam.SeamError) as info:
        seam.check(moved)
    message = str(info.value)
    assert f"in vLLM {vllm.__version__}, CPUModelRunner has no method _prepare_inputs (checked against vLLM 0.32.x)" in message
