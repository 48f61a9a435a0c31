"""Settings: precedence flags > environment > file > defaults, typed values, readable errors."""

from __future__ import annotations

from pathlib import Path

import pytest

from agent.settings import Settings, SettingsError, load_settings


def write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def test_defaults() -> None:
    settings = load_settings({}, {})
    assert settings == Settings()
    assert settings.sysfs_root == Path("/sys") and settings.backends is None and settings.log_level == "info"


def test_precedence_flags_over_env_over_file(scratch: Path) -> None:
    config = write(scratch / "agent.yaml", "node_name: from-file\nlog_level: debug\nsysfs_root: /file/sys\n")
    env = {"NODE_NAME": "from-env", "DRA_AGENT_LOG_LEVEL": "warning"}
    settings = load_settings({"node_name": "from-flag", "log_level": None}, env, config)
    assert settings.node_name == "from-flag"
    assert settings.log_level == "warning"
    assert settings.sysfs_root == Path("/file/sys")


def test_prefixed_env_beats_conventional_env() -> None:
    settings = load_settings({}, {"NODE_NAME": "plain", "DRA_AGENT_NODE_NAME": "prefixed", "KUBECONFIG": "/k"})
    assert settings.node_name == "prefixed"
    assert settings.kubeconfig == Path("/k")


def test_env_lists_and_mappings() -> None:
    env = {
        "DRA_AGENT_BACKENDS": "nvidia-gpu, tpu",
        "DRA_AGENT_DRIVER_NAMES": '{"gpu.nvidia.com": "gpu.example.org"}',
        "DRA_AGENT_BACKEND_CONFIG": '{"nvidia-mig": {"mode": "static"}}',
    }
    settings = load_settings({}, env)
    assert settings.backends == ("nvidia-gpu", "tpu")
    assert settings.driver_name("gpu.nvidia.com") == "gpu.example.org"
    assert settings.driver_name("tpu.google.com") == "tpu.google.com"
    assert settings.backend_config == {"nvidia-mig": {"mode": "static"}}


def test_file_accepts_dashed_keys(scratch: Path) -> None:
    config = write(scratch / "agent.yaml", "node-name: dashed\nbackends: [tpu]\n")
    settings = load_settings({}, {}, config)
    assert settings.node_name == "dashed" and settings.backends == ("tpu",)


def test_settings_are_frozen() -> None:
    settings = load_settings({}, {})
    with pytest.raises(ValueError):
        settings.node_name = "x"  # type: ignore[misc]


def test_errors_name_setting_value_and_source(scratch: Path) -> None:
    config = write(scratch / "agent.yaml", "log_level: loud\nbogus: 1\n")
    with pytest.raises(SettingsError) as caught:
        load_settings({}, {"NODE_NAME": "Bad_Node"}, config)
    text = str(caught.value)
    assert f"log_level = 'loud' (from config file {config})" in text
    assert "node_name = 'Bad_Node' (from environment NODE_NAME): must be a valid node name" in text
    assert "bogus = 1" in text and "unknown setting" in text


def test_invalid_driver_rename() -> None:
    with pytest.raises(SettingsError, match="not a valid DRA driver name"):
        load_settings({"driver_names": {"gpu.nvidia.com": "Not A Driver"}}, {})


def test_bad_json_in_env() -> None:
    with pytest.raises(SettingsError, match="DRA_AGENT_DRIVER_NAMES: expected a JSON object"):
        load_settings({}, {"DRA_AGENT_DRIVER_NAMES": "gpu=x"})


def test_unreadable_and_malformed_files(scratch: Path) -> None:
    with pytest.raises(SettingsError, match="cannot read config file"):
        load_settings({}, {}, scratch / "missing.yaml")
    with pytest.raises(SettingsError, match="not valid YAML at line 2"):
        load_settings({}, {}, write(scratch / "bad.yaml", "a: 1\n  b: [\n"))
    with pytest.raises(SettingsError, match="must hold a mapping"):
        load_settings({}, {}, write(scratch / "list.yaml", "- 1\n"))


def test_cli_reads_config_file_from_env(run_cli, scratch: Path, monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[no-untyped-def]
    config = write(scratch / "agent.yaml", "node_name: via-config\n")
    monkeypatch.setenv("DRA_AGENT_CONFIG", str(config))
    result = run_cli("discover", "--simulate", "gke-g2-l4", "-o", "json")
    assert result.code == 0
    assert '"nodeName": "via-config"' in result.out


def test_driver_root_defaults_to_the_host_root_and_lies_under_it() -> None:
    assert load_settings({}, {}).effective_driver_root == Path("/")
    assert load_settings({"host_root": Path("/host")}, {}).effective_driver_root == Path("/host")
    operator = load_settings({"host_root": Path("/host")}, {"DRA_AGENT_DRIVER_ROOT": "/host/run/nvidia/driver"})
    assert operator.effective_driver_root == Path("/host/run/nvidia/driver")
    assert load_settings({"host_root": Path("/host"), "driver_root": Path("/host/")}, {}).driver_root == Path("/host")


@pytest.mark.parametrize("driver_root", ["/run/nvidia/driver", "/hostile", "/host/../etc", "/host/run/../../x"])
def test_a_driver_root_outside_the_host_root_is_refused(driver_root: str) -> None:
    with pytest.raises(SettingsError) as caught:
        load_settings({"host_root": Path("/host"), "driver_root": Path(driver_root)}, {})
    text = str(caught.value)
    assert f"driver_root = PosixPath('{driver_root}') (from flag --driver-root): must lie under host_root /host" in text


def test_a_relative_driver_root_is_refused(scratch: Path) -> None:
    config = write(scratch / "agent.yaml", "driver_root: run/nvidia/driver\n")
    with pytest.raises(SettingsError, match=f"driver_root .* \\(from config file {config}\\): must be an absolute"):
        load_settings({}, {}, config)


def test_a_simulated_node_checks_its_driver_root_when_open(run_cli, scratch: Path) -> None:  # type: ignore[no-untyped-def]
    # The node's root (its host root) is known only once it is open: the refusal comes from there.
    result = run_cli("discover", "--simulate", "gke-g2-l4", "--sim-root", str(scratch / "node"),
                     "--driver-root", "/run/nvidia/driver")
    assert result.code == 2
    assert f"driver_root /run/nvidia/driver must lie under the simulated node's root {scratch / 'node'}" in result.err


def test_settings_made_in_code_read_only_their_arguments(monkeypatch: pytest.MonkeyPatch) -> None:
    # The environment is layered by load_settings alone: an agent or a test that builds Settings itself gets what
    # it asked for, whatever the process's environment holds.
    monkeypatch.setenv("DRA_AGENT_LOG_LEVEL", "debug")
    monkeypatch.setenv("NODE_NAME", "from-env")
    assert Settings().log_level == "info" and Settings().node_name is None
    assert load_settings({}, {}).log_level == "info"


def test_a_config_file_that_is_a_folder_is_refused(scratch: Path) -> None:
    with pytest.raises(SettingsError, match=f"cannot read config file {scratch}: Is a directory"):
        load_settings({}, {}, scratch)


def test_env_names_are_upper_case_only() -> None:
    assert load_settings({}, {"dra_agent_log_level": "debug", "Dra_Agent_Log_Level": "debug"}).log_level == "info"
