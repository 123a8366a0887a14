"""Settings: defaults, accepted spellings, and a specific message for every bad value."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from imgedit.config.parsers import GIB, DeviceMap, parse_size
from imgedit.config.settings import REGISTRY, load_settings
from imgedit.errors import SettingsError


def test_defaults():
    s = load_settings({})
    assert s.qwen_model == "Qwen/Qwen-Image-Edit-2509"
    assert s.device_map == DeviceMap("balanced")
    assert s.max_memory == ()
    assert s.torch_dtype == "bfloat16"
    assert s.gradio_server_port == 7860 and s.gradio_server_name == "127.0.0.1"
    assert s.model_source == "Qwen/Qwen-Image-Edit-2509"


def test_model_dir_wins_over_model_and_demo_wins_over_both():
    s = load_settings({"QWEN_MODEL": "a/b", "QWEN_MODEL_DIR": "/mnt/models"})
    assert s.model_source == "/mnt/models"
    s = load_settings({"QWEN_MODEL_DIR": "/mnt/models", "DEMO": "yes", "DEMO_DIR": "/tmp/demo"})
    assert s.model_source == "/tmp/demo"


@pytest.mark.parametrize("raw, expected", [
    ("balanced", DeviceMap("balanced")), ("AUTO", DeviceMap("auto")), ("replicas", DeviceMap("replicas")),
    ("cuda", DeviceMap("cuda", gpu=0)), ("cuda:3", DeviceMap("cuda", gpu=3)), ("cpu", DeviceMap("cpu")),
])
def test_device_map_modes(raw, expected):
    assert load_settings({"DEVICE_MAP": raw}).device_map == expected


def test_device_map_json():
    s = load_settings({"DEVICE_MAP": '{"transformer": {"0-29": "cuda:0"}, "vae": "cuda:0"}'})
    assert s.device_map.mode == "manual"
    assert s.device_map.manual["transformer"] == {"0-29": "cuda:0"}


def test_sizes_and_caps():
    assert parse_size("75GiB") == 75 * GIB
    assert parse_size("30GB") == 30 * 10**9
    assert parse_size("512 MiB") == 512 * 2**20
    s = load_settings({"MAX_MEMORY": "75GiB,70GiB"})
    assert s.max_memory == (75 * GIB, 70 * GIB)


def test_dtype_aliases():
    assert load_settings({"TORCH_DTYPE": "bf16"}).torch_dtype == "bfloat16"
    assert load_settings({"TORCH_DTYPE": "fp16"}).torch_dtype == "float16"


@pytest.mark.parametrize("name, value, allowed", [
    ("DEVICE_MAP", "gpu", "balanced, auto, replicas, cfg-parallel, cfg-parallel:4, cfg-parallel:8, ulysses:2"),
    ("DEVICE_MAP", "{not json", "valid JSON"),
    ("MAX_MEMORY", "75 gigs", "comma-separated sizes"),
    ("TORCH_DTYPE", "int8", "bfloat16, float16, float32"),
    ("QUEUE_MAX_SIZE", "0", "a whole number from 1 to 10000"),
    ("QUEUE_MAX_SIZE", "many", "a whole number"),
    ("GRADIO_SERVER_PORT", "70000", "from 1 to 65535"),
    ("DEFAULT_TRUE_CFG", "0.5", "a number from 1.0 to 20.0"),
    ("AUTO_CLEANUP", "maybe", "true/false"),
    ("LOG_LEVEL", "LOUD", "DEBUG, INFO, WARNING, ERROR"),
    ("GPU_MEMORY_RESERVE", "lots", "a size such as"),
    ("DEVICE_MAP", '{"transformer": {"0-59": 0}}', "device strings such as"),
    ("DEVICE_MAP", "[1, 2]", "a JSON object"),
    ("WORKER_THREADS", "0", "auto or a whole number from 1 to 256"),
    ("WORKER_THREADS", "many", "auto or a whole number from 1 to 256"),
])
def test_bad_values_name_variable_value_and_allowed(name, value, allowed):
    with pytest.raises(SettingsError) as info:
        load_settings({name: value})
    assert name in info.value.message and repr(value) in info.value.message and allowed in info.value.message


@pytest.mark.parametrize("name, value", [
    ("GRADIO_AUTH", "justuser-zqz"), ("API_KEYS", "ci:zqz"), ("API_KEYS", "a:zqz-one-1,a:zqz-two-2"),
    ("API_KEYS", "a:zqz-key-1,b:zqz-key-1"), ("GRADIO_AUTH", "@/nonexistent/zqz")])
def test_bad_credentials_are_refused_without_printing_them(name, value):
    with pytest.raises(SettingsError) as info:
        load_settings({name: value})
    assert f"{name}=(hidden) is not valid" in info.value.message
    assert "zqz" not in info.value.message


def test_several_logins_and_owned_keys_from_text_or_a_file(tmp_path):
    logins = tmp_path / "logins"
    logins.write_text("# page users\nann:pw,with,commas\nbob:pa:ss\n")
    s = load_settings({"GRADIO_AUTH": f"@{logins}", "API_KEYS": "ci:ci-key-123, alice:alice-key-456"})
    assert s.auth == [("ann", "pw,with,commas"), ("bob", "pa:ss")]
    assert s.api_keys == (("ci", "ci-key-123"), ("alice", "alice-key-456")) and s.keys_required
    assert load_settings({"GRADIO_AUTH": "ann:pw-1,bob:pw-2"}).auth == [("ann", "pw-1"), ("bob", "pw-2")]
    assert load_settings({}).auth is None and not load_settings({}).keys_required
    with pytest.raises(SettingsError, match="API_KEY is also one of API_KEYS"):
        load_settings({"API_KEY": "ci-key-123", "API_KEYS": "ci:ci-key-123"})


def test_default_steps_above_max_steps_is_refused():
    with pytest.raises(SettingsError, match="DEFAULT_STEPS=80 is above MAX_STEPS=60"):
        load_settings({"DEFAULT_STEPS": "80", "MAX_STEPS": "60"})


def test_all_problems_reported_at_once():
    with pytest.raises(SettingsError) as info:
        load_settings({"DEVICE_MAP": "x", "QUEUE_MAX_SIZE": "-1"})
    assert "DEVICE_MAP" in info.value.message and "QUEUE_MAX_SIZE" in info.value.message


def test_registry_names_are_unique():
    names = [v.name for v in REGISTRY]
    assert len(names) == len(set(names))


@pytest.mark.parametrize("env, message", [
    ({"DEVICE_MAP": "everything"}, "DEVICE_MAP='everything' is not valid"),
    # An output folder that cannot be made once ended in a FileNotFoundError traceback after the workers started.
    ({"OUTPUT_DIR": "/proc/nope"}, "OUTPUT_DIR='/proc/nope' cannot be used as a folder: No such file or directory"),
    ({"OUTPUT_DIR": "/sys/kernel"}, "OUTPUT_DIR='/sys/kernel' cannot be used as a folder: Permission denied"),
    ({"OUTPUT_DIR": "/dev/null/x"}, "OUTPUT_DIR='/dev/null/x' cannot be used as a folder: Not a directory"),
    # On a machine without a GPU, a DEVICE_MAP that names GPUs once served the demo model without a word.
    ({"DEVICE_MAP": "cuda"}, "DEVICE_MAP=cuda needs GPUs and none is visible here (NVML found none)"),
    ({"DEVICE_MAP": "ulysses:2"}, "DEVICE_MAP=ulysses:2 needs GPUs and none is visible here"),
], ids=["bad-value", "folder-cannot-be-made", "folder-not-writable", "under-a-file", "cuda-without-gpu",
        "group-without-gpus"])
def test_app_refuses_to_start_on_a_bad_setting(env, message):
    """python app.py stops at once with the message, before starting any worker (bad values before importing
    torch or gradio)."""
    # HOME: the default OUTPUT_DIR is made under it (the run's own, never the user's; conftest.py)
    proc = subprocess.run([sys.executable, "app.py"], env={**env, "PATH": "/usr/bin:/bin", "HOME": os.environ["HOME"]},
                          capture_output=True, text=True, timeout=120,
                          cwd=__import__("pathlib").Path(__file__).resolve().parents[1])
    assert proc.returncode == 2
    assert message in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr


def test_light_modules_import_without_torch_or_gradio():
    code = ("import sys, imgedit.config.settings, imgedit.planning.memory, imgedit.engine.validation, imgedit.errors, "
            "imgedit.protocol; print('torch' in sys.modules, 'gradio' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         cwd=__import__("pathlib").Path(__file__).resolve().parents[1])
    assert out.stdout.split() == ["False", "False"], out.stderr


def test_the_configuration_page_documents_every_setting():
    """Every setting has its row in docs/configuration.md (the README links there; .env.example: test_env_example)."""
    page = (__import__("pathlib").Path(__file__).resolve().parents[1] / "docs" / "configuration.md").read_text()
    missing = [v.name for v in REGISTRY if f"| `{v.name}` |" not in page]
    assert missing == [], f"docs/configuration.md's table lacks {missing}"


def test_worker_threads_for_gpu_workers_only():
    """WORKER_THREADS: auto is 4 per GPU process, fewer where the machine has fewer CPUs for its GPU processes,
    OMP_NUM_THREADS where set; a CPU worker keeps PyTorch's default (0); a number is used as given. The copies
    of streamed weights (modes.copy_threads) take each GPU process's whole share, whatever WORKER_THREADS is."""
    from imgedit.planning.modes import copy_threads, worker_threads
    from imgedit.planning.plan import Placement, WorkerPlan

    def worker(device: str, ranks: int = 1) -> WorkerPlan:
        plan = WorkerPlan("w", {c: Placement(device) for c in ("transformer", "text_encoder", "vae")})
        if ranks > 1:
            plan = WorkerPlan("w", plan.components, parallel="cfg", rank_devices=("cuda:0", "cuda:1"))
        return plan

    auto, eight = load_settings({}), load_settings({"WORKER_THREADS": "8"})
    assert auto.worker_threads == 0 and eight.worker_threads == 8
    one, pair, cpu = worker("cuda:0"), worker("cuda:0", ranks=2), worker("cpu")
    assert pair.ranks == 2
    assert worker_threads(auto, one, [one], 32, None) == 4  # a one-GPU worker: at most 4
    assert worker_threads(auto, pair, [pair], 32, None) == 16  # a pair's ranks: their share
    assert worker_threads(auto, one, [pair, pair, pair, one], 16, None) == 2  # 7 GPU processes on 16 CPUs
    assert worker_threads(auto, pair, [pair, pair, pair, one], 16, None) == 2
    assert worker_threads(auto, one, [one] * 8, 4, None) == 1
    assert worker_threads(auto, one, [one], 32, "6") == 6 and worker_threads(eight, one, [one], 32, "6") == 8
    assert worker_threads(auto, cpu, [cpu], 32, None) == 0 and worker_threads(eight, cpu, [cpu], 32, None) == 0
    ray = load_settings({"WORKERS": "ray"})  # the server's CPUs say nothing of a Ray node's: Ray's own setting
    assert worker_threads(ray, one, [one], 32, None) == 0
    assert worker_threads(load_settings({"WORKERS": "ray", "WORKER_THREADS": "6"}), one, [one], 32, None) == 6
    # while its streamed weights are copied into locked memory, a GPU process takes its whole share
    assert copy_threads(auto, one, [one], 16) == 16 and copy_threads(eight, one, [one], 16) == 16
    assert copy_threads(auto, one, [pair, pair, pair, one], 16) == 2 and copy_threads(auto, pair, [pair], 32) == 16
    assert copy_threads(auto, cpu, [cpu], 16) == 0 and copy_threads(ray, one, [one], 16) == 0
