"""docs/plugins.md is what the plugins' code says: regenerated, it is the same page."""

from epp.scheduling.plugins.max_score_picker import MaxScorePicker
from harness.plugin_reference import PAGE, page, recorded_parameters


def test_the_page_matches_the_code():
    assert PAGE.read_text() == page(), "docs/plugins.md is stale: run `python -m harness.plugin_reference --write`"


def test_parameters_and_defaults_are_read_from_the_plugin():
    assert recorded_parameters(MaxScorePicker) == [("maxNumOfEndpoints", 1)]
