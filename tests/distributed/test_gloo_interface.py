"""use_interface_of: a rank on a node of a cluster makes Gloo listen on the interface that holds
its node's address (Gloo would otherwise take the hostname's address, often 127.0.0.1)."""

import os

import pytest

from deepinfer_dp.distributed.groups import use_interface_of


def test_the_interface_holding_the_address_is_named_for_gloo(monkeypatch):
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "before")  # and restored after the test
    name = use_interface_of("127.0.0.1")
    assert name == "lo" and os.environ["GLOO_SOCKET_IFNAME"] == "lo"


def test_an_address_of_no_interface_is_refused_by_name(monkeypatch):
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "before")
    with pytest.raises(ValueError, match="192.0.2.77"):
        use_interface_of("192.0.2.77")  # TEST-NET-1: on no interface here
    assert os.environ["GLOO_SOCKET_IFNAME"] == "before"
