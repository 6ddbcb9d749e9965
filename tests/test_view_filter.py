"""`failover_view=models` (core/view_filter.py, mitm/model_view.py): the view filter that lists only the
model flows, checked with mitmproxy's own filter language."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from mitmproxy import flowfilter
from mitmproxy.test import tflow

from codex_failover.core.view_filter import models_filter
from codex_failover.mitm.model_view import ModelView


@pytest.mark.parametrize("url, listed", [
    ("https://chatgpt.com/backend-api/codex/responses", True),
    ("https://chatgpt.com/backend-api/codex/responses/compact", True),
    ("https://chatgpt.com/backend-api/codex/responses?client=1", True),
    ("https://api.openai.com/v1/responses", True),
    ("http://127.0.0.1:8123/v1/responses", True),  # the pool's base_url
    ("http://127.0.0.1:8124/v1/responses", False),  # another port
    ("https://chatgpt.com/backend-api/wham/usage", False),
    ("https://chatgpt.com/backend-api/codex/models", False),
    ("https://chatgpt.com/backend-api/plugins/list", False),
    ("https://chatgpt.com/backend-api/codex/responsesx", False),
    ("https://chatgptxcom/backend-api/codex/responses", False),  # a dot is a dot
    ("https://ab.chatgpt.com/backend-api/codex/responses", False),
])
def test_the_filter_lists_the_model_endpoints_only(url, listed):
    expr = models_filter(["http://127.0.0.1:8123/v1", "https://chatgpt.com/backend-api/codex"])
    assert "\\" not in expr
    flow = tflow.tflow()
    flow.request.url = url
    assert bool(flowfilter.parse(expr)(flow)) is listed


class Options(SimpleNamespace):
    def keys(self):
        return set(vars(self))


def test_the_view_filter_is_set_kept_in_step_and_given_back():
    view, opts = ModelView(), Options(failover_view="models", view_filter=None)
    view.configure(opts, [], {"failover_view"})
    first = opts.view_filter
    assert first == models_filter([])
    view.configure(opts, ["http://127.0.0.1:9/v1"], {"failover_config"})  # the pool changed
    assert opts.view_filter == models_filter(["http://127.0.0.1:9/v1"])
    opts.failover_view = "all"
    view.configure(opts, [], {"failover_view"})
    assert opts.view_filter is None


def test_a_users_own_view_filter_is_left_alone_and_mitmdump_has_none():
    opts = Options(failover_view="models", view_filter="~d example.com")
    ModelView().configure(opts, [], {"failover_view"})
    assert opts.view_filter == "~d example.com"
    dump = Options(failover_view="models")
    ModelView().configure(dump, [], {"failover_view"})
    assert not hasattr(dump, "view_filter")
