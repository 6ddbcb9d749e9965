import pytest
import yaml

from codex_failover.core.rules import RulesError, parse_rules
from codex_failover.rules_file import DEFAULT_RULES_PATH, load_rules


def default_doc():
    return yaml.safe_load(DEFAULT_RULES_PATH.read_text())


def test_default_rules_load(rules):
    assert "response.created" in rules.bufferable_events
    assert rules.rejection_class("server_is_overloaded", None, None) == "overloaded"
    assert rules.rejection_class("SLOW_DOWN", None, None) == "slow_down"
    assert rules.rejection_class(None, None, "Selected model is AT CAPACITY.") == "capacity"  # case-insensitive
    assert rules.rejection_class(None, None, "the queue is at capacity") is None  # needs the whole phrase
    assert rules.rejection_class(None, None, "Selected model is at capacity.") == "capacity"
    assert rules.rejection_class("server_error", None, "boom") is None
    assert rules.rejection_class(None, None, None, status=503) == "overloaded"
    assert rules.rejection_class("invalid_request", None, "bad", status=400) is None


def test_user_can_extend_rules(tmp_path):
    doc = default_doc()
    doc["rejections"].append({"class": "overloaded", "messages": ["too busy right now"]})
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(doc))
    assert load_rules(path).rejection_class(None, None, "We are TOO busy right now") == "overloaded"


@pytest.mark.parametrize(
    "mutate,needle",
    [
        (lambda d: d.update(bogus=1), "unknown field(s) bogus"),
        (lambda d: d.update(version=2), "version"),
        (lambda d: d["bootstrap"].update(max_frames=0), "bootstrap.max_frames"),
        (lambda d: d["bootstrap"].update(max_bytes="lots"), "bootstrap.max_bytes"),
        (lambda d: d["bufferable"].update(events="response.created"), "bufferable.events"),
        (lambda d: d["bufferable"].update(empty_items=["web_search_call"]), "bufferable.empty_items: unknown type(s) web_search_call"),
        (lambda d: d["rejections"].append({"class": "x"}), "rejections[13]: needs at least one"),
        (lambda d: d["rejections"].append({"class": "x", "codes": ["y"], "plain_text": True}), "rejections[13].plain_text"),
        (lambda d: d["rejections"].append({"class": "x", "statuses": [502], "plain_text": "yes"}), "rejections[13].plain_text"),
        (lambda d: d["rejections"][0].update(statuses=[999]), "rejections[0].statuses"),
        (lambda d: d["rejections"][0].update(headers=["cf-mitigated"]), "rejections[0].headers: expected a mapping"),
        (lambda d: d["rejections"][0].update(headers={"cf-mitigated": "challenge"}), "rejections[0].headers.cf-mitigated"),
        (lambda d: d["rejections"][0].update(params="model"), "rejections[0].params"),
        (lambda d: d["rejections"][0].update(require_status=[1000]), "rejections[0].require_status"),
        (lambda d: d["rejections"][0].update(require_param="model"), "rejections[0].require_param"),
        (lambda d: d["rejections"][0].pop("class"), "rejections[0].class"),
        (lambda d: d.update(rejections=[]), "rejections: expected a non-empty list"),
    ],
)
def test_invalid_rules_name_the_field(mutate, needle):
    doc = default_doc()
    mutate(doc)
    with pytest.raises(RulesError) as info:
        parse_rules(doc, "my.yaml")
    assert "my.yaml" in str(info.value)
    assert needle in str(info.value)


def test_unreadable_and_invalid_yaml_files(tmp_path):
    with pytest.raises(RulesError, match="cannot read"):
        load_rules(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("rejections: [unclosed\n")
    with pytest.raises(RulesError, match=r"bad\.yaml: not valid YAML"):
        load_rules(bad)
    empty = tmp_path / "empty.yaml"
    empty.write_text("")
    with pytest.raises(RulesError, match="expected a mapping"):
        load_rules(empty)
