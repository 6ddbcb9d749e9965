"""A fake of ChatGPT's token endpoint (`POST /oauth/token`), served by the fake upstream.

It rotates refresh tokens as the real one does: a refresh token works once; using it again answers
401 `refresh_token_reused`; an unknown one 401 `refresh_token_invalidated`. Each refresh issues a new
access token (a JWT naming the account, ending in 10 days) and revokes the old one: the fake upstream
answers a model request carrying a revoked access token with 401. Test controls (POST):
`/_fake/oauth/account` {"account", "refresh_token", "access_token", "revoked"?} seeds an account's
login (`revoked`: its access token is refused already);
`/_fake/oauth/next` {"scenario": "refresh_token_expired" | "invalid_grant" | "transient" | "race",
"path": auth.json, "delay"?: seconds} decides the next answer ("race": someone else, as Codex would,
refreshes that file first, so this request's token has been used: 401 refresh_token_reused; `delay`:
the answer comes that much later).
"""

from __future__ import annotations

import base64
import datetime
import json
import os
import time

CLIENT_ID = "app_EMoamEEZ73f0CkXaXp7hrann"


def jwt(claims: dict) -> str:
    enc = lambda d: base64.urlsafe_b64encode(json.dumps(d).encode()).rstrip(b"=").decode()  # noqa: E731
    return f"{enc({'alg': 'none', 'typ': 'JWT'})}.{enc(claims)}.c2ln"


def access_token(account: str, n: int, exp: float | None = None) -> str:
    return jwt({"exp": int(exp if exp is not None else time.time() + 10 * 86400), "n": n,
                "https://api.openai.com/auth": {"chatgpt_account_id": account, "chatgpt_user_id": "user-1",
                                                "chatgpt_plan_type": "plus"}})


def id_token(account: str) -> str:
    return jwt({"email": "user@example.com", "exp": int(time.time() + 3600),
                "https://api.openai.com/auth": {"chatgpt_account_id": account, "chatgpt_user_id": "user-1",
                                                "chatgpt_plan_type": "plus"}})


def auth_json(account: str, access: str, refresh: str, last_refresh: float) -> dict:
    """An auth.json as Codex writes it."""
    at = datetime.datetime.fromtimestamp(last_refresh, datetime.timezone.utc)
    return {"auth_mode": "chatgpt", "OPENAI_API_KEY": None,
            "tokens": {"id_token": id_token(account), "access_token": access, "refresh_token": refresh,
                       "account_id": account},
            "last_refresh": at.strftime("%Y-%m-%dT%H:%M:%S.%fZ")}


class FakeOAuth:
    def __init__(self, log) -> None:
        self.log = log  # the fake upstream's logger
        self.live: dict[str, str] = {}  # refresh token -> account (usable once)
        self.used: set[str] = set()
        self.access: dict[str, str] = {}  # account -> its access token in force
        self.revoked: set[str] = set()  # access tokens replaced by a refresh
        self.next: list[dict] = []
        self.issued = 0

    def seed(self, order: dict) -> None:
        self.live[order["refresh_token"]] = order["account"]
        self.access[order["account"]] = order["access_token"]
        if order.get("revoked"):  # its access token no longer works (a model request gets 401)
            self.revoked.add(order["access_token"])

    def _rotate(self, token: str) -> dict:
        account = self.live.pop(token)
        self.used.add(token)
        self.issued += 1
        old = self.access.get(account)
        if old:
            self.revoked.add(old)
        new = {"id_token": id_token(account), "access_token": access_token(account, self.issued),
               "refresh_token": f"rt-{account}-{self.issued}"}
        self.access[account] = new["access_token"]
        self.live[new["refresh_token"]] = account
        return new

    def token(self, body: bytes, headers: dict[str, str]) -> tuple[int, dict]:
        """(status, JSON answer) for one refresh request."""
        try:
            doc = json.loads(body)
        except ValueError:
            doc = {}
        token = doc.get("refresh_token", "")
        record = {"ts": time.time(), "event": "oauth", "client_id_ok": doc.get("client_id") == CLIENT_ID,
                  "grant_type_ok": doc.get("grant_type") == "refresh_token",
                  "content_type": headers.get("content-type"), "account": self.live.get(token)}
        order = self.next.pop(0) if self.next else {}
        scenario = order.get("scenario", "")
        if scenario == "transient":
            status, answer = 503, {"error": {"message": "try later"}}
        elif scenario in ("refresh_token_expired", "refresh_token_invalidated"):
            status, answer = 401, {"error": {"code": scenario, "message": "SECRET-ANSWER-TEXT"}}
        elif scenario == "invalid_grant":
            status, answer = 400, {"error": "invalid_grant", "error_description": "SECRET-ANSWER-TEXT"}
        elif token in self.live and scenario == "race":
            account = self.live[token]
            new = self._rotate(token)  # someone else (a Codex) refreshed with this token first
            path = order["path"]
            tmp = f"{path}.race"
            with open(tmp, "w") as out:
                json.dump(auth_json(account, new["access_token"], new["refresh_token"], time.time()), out, indent=2)
            os.chmod(tmp, os.stat(path).st_mode & 0o777)
            os.replace(tmp, path)
            status, answer = 401, {"error": {"code": "refresh_token_reused", "message": "SECRET-ANSWER-TEXT"}}
        elif token in self.live:
            status, answer = 200, self._rotate(token)
        elif token in self.used:
            status, answer = 401, {"error": {"code": "refresh_token_reused", "message": "SECRET-ANSWER-TEXT"}}
        else:
            status, answer = 401, {"error": {"code": "refresh_token_invalidated", "message": "SECRET-ANSWER-TEXT"}}
        record.update(status=status, scenario=scenario or "rotate",
                      result=(answer.get("error") or {}).get("code") if isinstance(answer.get("error"), dict) else
                      answer.get("error", "ok"))
        self.log(record)
        return status, answer
