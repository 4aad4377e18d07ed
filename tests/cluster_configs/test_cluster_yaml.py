"""Every `ray up` config in cluster/ passes Ray's own validation and puts each role on the right node.

Local-provider configs go through the same `_bootstrap_config` that `ray up` runs
(prepare, fill defaults, JSON-schema validation); the AWS one through
`prepare_config` + `validate_config` (its provider bootstrap needs AWS credentials).
Then: the target role is on the head's `ray start`, the draft role on the workers',
as a node label and as the custom-resource fallback. Needs no root, no network.
"""

import copy
import json
import re
import shlex
from pathlib import Path

import pytest
import yaml

ray = pytest.importorskip("ray")
pytest.importorskip("jsonschema")  # Ray's validator needs it (ray[default])

from ray._private.label_utils import parse_node_labels_string  # noqa: E402
from ray.autoscaler._private.commands import _bootstrap_config  # noqa: E402
from ray.autoscaler._private.util import prepare_config, validate_config  # noqa: E402

CLUSTER_DIR = Path(__file__).resolve().parents[2] / "cluster"
ROLE_KEY = "specserve.io/role"
ROLE_RESOURCE = {"target": "specserve_target", "draft": "specserve_draft"}
LOCAL_CONFIGS = ["onprem-spark-5090.yaml", "local-twohost.yaml"]
CLOUD_CONFIGS = ["aws-draft-target.yaml"]
ALL_CONFIGS = LOCAL_CONFIGS + CLOUD_CONFIGS


def load(name: str) -> dict:
    with open(CLUSTER_DIR / name) as f:
        return yaml.safe_load(f)


def ray_start_lines(commands: list) -> list:
    return [c for c in commands if re.search(r"\bray start\b", c)]


def flag_value(cmd: str, flag: str):
    """The value of `--flag=value` in a shell command, with shell quoting removed."""
    for word in shlex.split(cmd):
        if word.startswith(flag + "="):
            return word[len(flag) + 1 :]
    return None


def role_of(cmd: str):
    """(labels, resources) that a `ray start` line gives its node."""
    labels_str = flag_value(cmd, "--labels")
    resources_str = flag_value(cmd, "--resources")
    labels = parse_node_labels_string(labels_str) if labels_str is not None else {}
    resources = json.loads(resources_str) if resources_str is not None else {}
    return labels, resources


def test_all_configs_present():
    found = sorted(p.name for p in CLUSTER_DIR.glob("*.yaml"))
    assert found == sorted(ALL_CONFIGS), "add new cluster/*.yaml files to this test"


@pytest.mark.parametrize("name", LOCAL_CONFIGS)
def test_local_config_passes_ray_up_validation(name):
    config = load(name)
    assert "available_node_types" not in config, "the local provider rejects node types"
    resolved = _bootstrap_config(copy.deepcopy(config), no_config_cache=True)
    validate_config(resolved)
    node_type = resolved["available_node_types"][resolved["head_node_type"]]
    assert node_type["min_workers"] == len(config["provider"]["worker_ips"])


@pytest.mark.parametrize("name", CLOUD_CONFIGS)
def test_cloud_config_passes_ray_validation(name):
    prepared = prepare_config(load(name))
    validate_config(prepared)


@pytest.mark.parametrize("name", ALL_CONFIGS)
def test_start_lines_parse_and_enable_token_auth(name):
    config = load(name)
    for key in ("head_start_ray_commands", "worker_start_ray_commands"):
        starts = ray_start_lines(config[key])
        assert len(starts) == 1, f"{key}: expected one `ray start` line"
        cmd = starts[0]
        shlex.split(cmd)  # balanced quoting
        assert "RAY_AUTH_MODE=token" in cmd, f"{key}: token auth must be on"
        assert "specserve-node.env" in cmd, f"{key}: node env file not exported"
    head = ray_start_lines(config["head_start_ray_commands"])[0]
    assert flag_value(head, "--dashboard-host") == "127.0.0.1"
    assert config["file_mounts"].get("~/.ray/auth_token"), "token not shipped to nodes"


@pytest.mark.parametrize("name", ALL_CONFIGS)
def test_the_head_starts_with_direct_ingress_where_the_serve_config_expects_it(name):
    """The router serves 8000 itself (Serve's direct ingress, read when the head starts) and Serve's
    proxy, in deployments/two_node.yaml, takes the next port; the two must agree."""
    from specserve.serve.ingress import shell_exports

    head = ray_start_lines(load(name)["head_start_ray_commands"])[0]
    assert shell_exports(8000) in head
    serve_config = yaml.safe_load((CLUSTER_DIR.parent / "deployments" / "two_node.yaml").read_text())
    assert serve_config["http_options"]["port"] == 8001


@pytest.mark.parametrize("name", LOCAL_CONFIGS)
def test_local_roles_on_start_lines(name):
    config = load(name)
    for key, role in (
        ("head_start_ray_commands", "target"),
        ("worker_start_ray_commands", "draft"),
    ):
        cmd = ray_start_lines(config[key])[0]
        labels, resources = role_of(cmd)
        assert labels == {ROLE_KEY: role}, (key, labels)
        assert resources == {ROLE_RESOURCE[role]: 1}, (key, resources)
        # Ray's YAML examples warn: a space after the colon breaks the quoting.
        assert f"--resources='{{\"{ROLE_RESOURCE[role]}\":1}}'" in cmd
    head = ray_start_lines(config["head_start_ray_commands"])[0]
    node_ip = flag_value(head, "--node-ip-address")
    assert node_ip in (None, config["provider"]["head_ip"])
    # `ray up` enables autoscaler v2, which never starts local-provider workers.
    assert "RAY_enable_autoscaler_v2=0" in head


@pytest.mark.parametrize("name", CLOUD_CONFIGS)
def test_cloud_roles_on_node_types(name):
    config = load(name)
    node_types = config["available_node_types"]
    head_type = node_types[config["head_node_type"]]
    assert head_type["labels"] == {ROLE_KEY: "target"}
    assert head_type["resources"][ROLE_RESOURCE["target"]] == 1
    drafts = [t for n, t in node_types.items() if n != config["head_node_type"]]
    assert len(drafts) == 1 and drafts[0]["labels"] == {ROLE_KEY: "draft"}
    assert drafts[0]["resources"][ROLE_RESOURCE["draft"]] == 1
    assert drafts[0]["min_workers"] >= 1
    for key in ("head_start_ray_commands", "worker_start_ray_commands"):
        labels, resources = role_of(ray_start_lines(config[key])[0])
        assert not labels and not resources, "roles come from node types here"


@pytest.mark.parametrize("name", ["onprem-spark-5090.yaml", "aws-draft-target.yaml"])
def test_real_clusters_pin_python_and_ray(name):
    config = load(name)
    common = "\n".join(config["setup_commands"])
    assert f"=={ray.__version__}\"" in common, "pin the launcher's Ray version"
    assert re.search(r"--python 3\.11\.\d+", common), "pin the Python patch version"
    pins = set(re.findall(r"ray\[[a-z,]+\]==([\d.]+)", yaml.safe_dump(config)))
    assert pins == {ray.__version__}


def test_onprem_cupy_per_node():
    config = load("onprem-spark-5090.yaml")
    head = "\n".join(config["head_setup_commands"])
    worker = "\n".join(config["worker_setup_commands"])
    assert "cupy-cuda13x" in head and "cupy-cuda12x" not in head  # Spark: CUDA 13
    assert re.search(r"cupy-cuda1[23]x", worker)  # 5090: CUDA 12.8+ or 13
