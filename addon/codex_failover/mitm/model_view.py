"""`failover_view=models`: mitmweb's (or the console's) `view_filter` set to the model endpoints' flows
(core/view_filter.py), kept in step with the pool file's base URLs. A filter the user set themselves
is left alone; `failover_view=all` takes back only the addon's own. mitmdump has no view: nothing to do."""

from __future__ import annotations

import logging

from ..core.view_filter import MODELS, models_filter

log = logging.getLogger("codex_failover")


class ModelView:
    def __init__(self) -> None:
        self.set: str | None = None  # the filter this addon set, while it is in force

    def configure(self, options, base_urls, updated: set[str]) -> None:
        if not {"failover_view", "failover_config", "view_filter"} & updated or "view_filter" not in options.keys():
            return
        current = options.view_filter
        if current not in (None, "", self.set):
            return  # the user's own filter
        wanted = models_filter(base_urls) if options.failover_view == MODELS else None
        if wanted != current and (wanted is not None or self.set is not None):
            self.set = wanted
            options.view_filter = wanted
            if wanted is not None:
                log.info("codex-failover: failover_view=models: listing only the model requests and their attempts")
