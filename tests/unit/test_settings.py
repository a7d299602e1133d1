"""Process settings: AIQ_* parsing, validation errors naming the variable, flags winning."""

from __future__ import annotations

import pytest

from extproc.cli import main
from extproc.settings import Settings, SettingsError

pytestmark = pytest.mark.unit


def test_defaults_without_environment() -> None:
    s = Settings.from_env({})
    assert s == Settings()
    assert (s.config, s.redis_url, s.grpc_address) == (
        "config/demo.yaml",
        "redis://127.0.0.1:6379/0",
        "127.0.0.1:50051",
    )
    assert (s.log_format, s.log_level, s.workers, s.reuse_port, s.event_loop) == (
        "json",
        "info",
        1,
        False,
        "uvloop",
    )
    assert (s.metrics_port, s.shutdown_grace_s, s.drain_notice_s) == (0, 10.0, 2.5)


def test_every_variable_is_read() -> None:
    s = Settings.from_env(
        {
            "AIQ_CONFIG": "rules.yaml",
            "AIQ_REDIS_URL": "redis://r:1/2",
            "AIQ_GRPC_ADDRESS": "0.0.0.0:9",
            "AIQ_KEY_PREFIX": "p",
            "AIQ_LOG_FORMAT": "console",
            "AIQ_LOG_LEVEL": "DEBUG",
            "AIQ_METRICS_PORT": "9100",
            "AIQ_USAGE_ADDRESS": "127.0.0.1:7",
            "AIQ_WORKERS": "4",
            "AIQ_REUSEPORT": "1",
            "AIQ_EVENT_LOOP": "asyncio",
            "AIQ_SHUTDOWN_GRACE_S": "2.5",
            "AIQ_DRAIN_NOTICE_S": "0",
            "AIQ_WORKER_INDEX": "3",  # set by the supervisor for its workers: not a setting
            "UNRELATED": "x",
        }
    )
    assert s.config == "rules.yaml"
    assert s.redis_url == "redis://r:1/2"
    assert s.grpc_address == "0.0.0.0:9"
    assert s.key_prefix == "p"
    assert s.log_format == "console"
    assert s.log_level == "debug"
    assert s.metrics_port == 9100
    assert s.usage_address == "127.0.0.1:7"
    assert s.workers == 4
    assert s.reuse_port is True
    assert s.event_loop == "asyncio"
    assert s.shutdown_grace_s == 2.5
    assert s.drain_notice_s == 0.0


def test_flags_win_and_none_flags_do_not() -> None:
    env = {"AIQ_WORKERS": "2", "AIQ_CONFIG": "env.yaml", "AIQ_LOG_FORMAT": "console"}
    s = Settings.from_env(env, workers=5, config=None, log_format="json")
    assert (s.workers, s.config, s.log_format) == (5, "env.yaml", "json")


def test_empty_variable_counts_as_unset() -> None:
    assert Settings.from_env({"AIQ_EVENT_LOOP": "", "AIQ_WORKERS": ""}) == Settings()


def test_reuseport_false_spellings() -> None:
    for v in ("0", "false", "no"):
        assert Settings.from_env({"AIQ_REUSEPORT": v}).reuse_port is False


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({"AIQ_LOG_FORMAT": "jsn"}, "AIQ_LOG_FORMAT='jsn': Input should be 'json' or 'console'"),
        ({"AIQ_WORKERS": "x"}, "AIQ_WORKERS='x': Input should be a valid integer"),
        ({"AIQ_WORKERS": "0"}, "AIQ_WORKERS='0': Input should be greater than or equal to 1"),
        ({"AIQ_EVENT_LOOP": "trio"}, "AIQ_EVENT_LOOP='trio': Input should be 'uvloop' or"),
        ({"AIQ_REUSEPORT": "maybe"}, "AIQ_REUSEPORT='maybe': Input should be a valid boolean"),
        ({"AIQ_METRICS_PORT": "70000"}, "AIQ_METRICS_PORT='70000': Input should be less than"),
        ({"AIQ_SHUTDOWN_GRACE_S": "soon"}, "AIQ_SHUTDOWN_GRACE_S='soon': Input should be"),
        ({"AIQ_LOG_LEVEL": "loud"}, "AIQ_LOG_LEVEL='loud': Input should be 'debug'"),
    ],
)
def test_bad_value_names_the_variable(env: dict[str, str], expected: str) -> None:
    with pytest.raises(SettingsError) as info:
        Settings.from_env(env)
    assert expected in str(info.value)


def test_every_bad_variable_is_reported_at_once() -> None:
    with pytest.raises(SettingsError) as info:
        Settings.from_env({"AIQ_WORKERS": "x", "AIQ_LOG_FORMAT": "jsn"})
    assert "AIQ_WORKERS" in str(info.value)
    assert "AIQ_LOG_FORMAT" in str(info.value)


def test_bad_flag_value_names_the_flag() -> None:
    with pytest.raises(SettingsError, match=r"--workers=0: Input should be greater"):
        Settings.from_env({}, workers=0)


def test_settings_are_immutable() -> None:
    s = Settings()
    with pytest.raises(ValueError, match="frozen"):
        s.workers = 2


def test_serve_exits_2_with_the_message(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("AIQ_LOG_FORMAT", "jsn")
    assert main(["serve"]) == 2
    err = capsys.readouterr().err
    assert "ai-quota serve: invalid settings" in err
    assert "AIQ_LOG_FORMAT='jsn'" in err
    assert "Traceback" not in err


def test_the_ports_credentials_reach_every_worker() -> None:
    """`serve --workers N` hands the door's flags to each worker as AIQ_* variables that read
    back to the same settings (the health-only port to the first worker alone)."""
    from extproc.supervisor import Supervisor, Worker

    s = Settings.from_env(
        {},
        workers=2,
        grpc_token_file="/run/tokens",
        grpc_tls_cert="/run/tls.crt",
        grpc_tls_key="/run/tls.key",
        grpc_tls_client_ca="/run/ca.pem",
        grpc_allowed_sans="envoy,envoy-canary",
        health_address="0.0.0.0:8081",
    )
    sup = Supervisor(s)
    first = Settings.from_env(sup._env(Worker(0, s.grpc_address)))
    second = Settings.from_env(sup._env(Worker(1, s.grpc_address)))
    for w in (first, second):
        assert (w.grpc_token_file, w.grpc_tls_cert, w.grpc_tls_key) == (
            "/run/tokens",
            "/run/tls.crt",
            "/run/tls.key",
        )
        assert w.grpc_tls_client_ca == "/run/ca.pem" and w.allowed_sans == ["envoy", "envoy-canary"]
        assert not w.insecure
    assert first.health_address == "0.0.0.0:8081" and second.health_address == ""


def test_allowance_settings_are_read_and_bounded() -> None:
    s = Settings.from_env(
        {
            "AIQ_ALLOWANCES": "1",
            "AIQ_ALLOWANCE_SHARE": "0.2",
            "AIQ_ALLOWANCE_TTL_MS": "500",
            "AIQ_ALLOWANCE_MIN_RATE": "3",
            "AIQ_ALLOWANCE_MAX_WINDOW_S": "86400",
            "AIQ_ALLOWANCE_TRANCHES": "8",
        }
    )
    assert s.allowances and s.allowance_share == 0.2 and s.allowance_ttl_ms == 500
    assert s.allowance_min_rate == 3 and s.allowance_max_window_s == 86400
    assert s.allowance_tranches == 8 and Settings.from_env({}).allowance_tranches == 4
    with pytest.raises(SettingsError, match="AIQ_ALLOWANCE_TRANCHES"):
        Settings.from_env({"AIQ_ALLOWANCE_TRANCHES": "0"})
    assert Settings.from_env({}).allowances is True  # on by default (issue 35)
    assert Settings.from_env({"AIQ_ALLOWANCES": "0"}).allowances is False  # still turns them off
    with pytest.raises(SettingsError, match="AIQ_ALLOWANCE_SHARE"):
        Settings.from_env({"AIQ_ALLOWANCE_SHARE": "0.9"})  # more than half the room: refused
