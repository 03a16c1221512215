"""The elastic EP routes where they cannot work: a server without --enable-elastic-ep answers
404 naming the flag, and `serve --enable-elastic-ep` refuses a dp 1 server or several API
servers before anything starts. (Scaling itself: tests/cluster/test_elastic.py.)"""

from __future__ import annotations

import argparse

import httpx
import pytest
from server_utils import served

from deepinfer_dp.entrypoints.openai.launcher import add_serve_args, run_serve


def test_the_routes_answer_404_naming_the_flag_when_off(model_dir):
    with served(model_dir) as srv:
        r = httpx.post(srv.url + "/scale_elastic_ep", json={"new_data_parallel_size": 2})
        assert r.status_code == 404 and "--enable-elastic-ep" in r.json()["error"]["message"]
        r = httpx.get(srv.url + "/is_scaling_elastic_ep")
        assert r.status_code == 404 and r.json()["error"]["code"] == "elastic_ep_disabled"


@pytest.mark.parametrize("flags", [[], ["--dp-size", "2", "--api-server-count", "2"]])
def test_serve_refuses_elastic_ep_where_it_cannot_scale(model_dir, flags):
    args = add_serve_args(argparse.ArgumentParser()).parse_args([model_dir, "--enable-elastic-ep", *flags])
    with pytest.raises(SystemExit, match="--enable-elastic-ep needs dp_size > 1 over Ray"):
        run_serve(args)
