"""Serve's direct ingress: the environment a head needs, and the router's wait for its port."""

from __future__ import annotations

import socket

import pytest

from specserve.serve import ingress

from ..conftest import free_ports


def test_the_head_environment_names_the_routers_ports_then_the_proxys():
    env = ingress.direct_ingress_env(8000, router_replicas=2)
    assert env[ingress.SWITCH] == "1"
    # Serve's range is [MIN, MAX): the routers take 8000 and 8001; Serve's proxy takes MAX
    assert (env[ingress.MIN_PORT], env[ingress.MAX_PORT]) == ("8000", "8002")
    assert env["RAY_SERVE_PORT_QUARANTINE_S"] == "0"
    assert ingress.shell_exports(8000, 2).split() == [f"{k}={v}" for k, v in env.items()]
    with pytest.raises(ValueError, match="port 65535"):
        ingress.direct_ingress_env(65535)


def _time_wait_port() -> int:
    """A port whose listener is gone but whose last connection sits in TIME_WAIT (the server closed first)."""
    port = free_ports(1)
    with socket.socket() as listener:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", port))
        listener.listen()
        client = socket.create_connection(("127.0.0.1", port))
        conn, _ = listener.accept()
        conn.close()  # the server's side closes first: its end goes to TIME_WAIT
        client.recv(1)
        client.close()
    return port


def test_a_port_in_time_wait_is_waited_for_and_reported(monkeypatch):
    port = _time_wait_port()
    assert not ingress._bindable("127.0.0.1", port)  # what Serve's bind (no SO_REUSEADDR) would meet
    monkeypatch.setenv(ingress.MIN_PORT, str(port))
    monkeypatch.setenv(ingress.MAX_PORT, str(port + 1))
    assert ingress.wait_for_ports("127.0.0.1", timeout_s=1.0) == [port]


def test_free_ports_and_ports_a_sibling_router_serves_need_no_wait(monkeypatch):
    port = free_ports(2)
    monkeypatch.setenv(ingress.MIN_PORT, str(port))
    monkeypatch.setenv(ingress.MAX_PORT, str(port + 2))
    with socket.socket() as sibling:
        sibling.bind(("127.0.0.1", port))
        sibling.listen()
        assert ingress.wait_for_ports("127.0.0.1", timeout_s=5.0) == []


def test_without_direct_ingress_there_is_nothing_to_wait_for(monkeypatch):
    monkeypatch.delenv(ingress.MIN_PORT, raising=False)
    assert ingress.wait_for_ports("127.0.0.1", timeout_s=5.0) == []
