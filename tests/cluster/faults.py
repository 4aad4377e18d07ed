"""Fault injection inside target replicas, installed at each replica process's start by
``faults_site/sitecustomize.py`` (the replicas' ``runtime_env`` puts that folder on PYTHONPATH).

A request whose id carries ``FAIL_MARK`` fails inside an engine step (its commit raises) once it
has ``FAIL_AFTER`` output tokens, on whichever replica first serves it; its resumed copies (ids
ending ``-r<n>``) run normally. Nothing else changes.
"""

from __future__ import annotations

import re

FAIL_MARK = "inject-step-failure"
FAIL_AFTER = 8
_RESUMED = re.compile(r"-r\d+$")


def install() -> None:
    from specserve.target import TargetSide

    commit = TargetSide._commit

    def failing_commit(self, s, *args, **kwargs):
        if FAIL_MARK in s.request_id and not _RESUMED.search(s.request_id) and len(s.stopper.output_token_ids) >= FAIL_AFTER:
            raise RuntimeError("injected failure inside a target step")
        return commit(self, s, *args, **kwargs)

    TargetSide._commit = failing_commit
