"""Plugin stability levels, as llm-d router's: each built-in plugin type declares one, an Alpha plugin runs only with
--allow-experimental-plugins, and a config without the flag fails at startup naming every Alpha plugin."""

import pytest

from epp.cli import build_parser
from epp.config import ConfigError
from epp.config.loader import DEFAULT_CONFIG, LLM_D_DEFAULT_CONFIG, load
from epp.scheduling.framework import Scorer, Stability, register
from epp.scheduling.plugins import BUILTIN_PLUGINS, PLUGIN_TYPES
from epp.scheduling.scheduler import Scheduler

# llm-d router's levels for the types both have (its cmd/epp/runner/runner.go registers each with one)
LLM_D_LEVELS = {
    "active-request-scorer": Stability.BETA,
    "header-based-testing-filter": Stability.BETA,
    "kv-cache-utilization-scorer": Stability.BETA,
    "lora-affinity-scorer": Stability.BETA,
    "max-score-picker": Stability.BETA,
    "precise-prefix-cache-scorer": Stability.BETA,
    "prefix-cache-affinity-filter": Stability.BETA,
    "prefix-cache-scorer": Stability.BETA,
    "queue-scorer": Stability.BETA,
    "random-picker": Stability.BETA,
    "running-requests-size-scorer": Stability.BETA,
    "session-affinity-scorer": Stability.ALPHA,
    "token-load-scorer": Stability.BETA,
    "weighted-random-picker": Stability.BETA,
}
SESSIONS = """\
plugins:
- type: session-affinity-scorer
- {type: session-affinity-scorer, name: second}
- {type: queue-scorer, parameters: {unknownParameter: 1}}
schedulingProfiles:
- name: default
  plugins:
  - pluginRef: session-affinity-scorer
  - pluginRef: second
  - pluginRef: queue-scorer
"""


def test_every_built_in_plugin_has_a_level_and_llm_d_s_where_llm_d_has_the_type():
    assert all(isinstance(cls.stability, Stability) for cls in BUILTIN_PLUGINS)
    assert {t: PLUGIN_TYPES[t].stability for t in LLM_D_LEVELS} == LLM_D_LEVELS


@pytest.mark.parametrize("config", [DEFAULT_CONFIG, LLM_D_DEFAULT_CONFIG])
def test_the_default_profiles_run_without_the_flag(config):
    assert not [p for p in load(config).plugins if PLUGIN_TYPES[p["type"]].stability is Stability.ALPHA]
    Scheduler.from_config(config)


def test_an_alpha_plugin_needs_the_flag_and_the_error_names_every_one_with_the_other_errors():
    with pytest.raises(ConfigError) as error:
        Scheduler.from_config(SESSIONS)
    message = str(error.value)
    assert "'session-affinity-scorer' (type 'session-affinity-scorer')" in message
    assert "'second' (type 'session-affinity-scorer')" in message
    assert "Alpha" in message and "--allow-experimental-plugins" in message
    assert "unknownParameter" in message  # the document's other errors in the same message
    fixed = SESSIONS.replace(", parameters: {unknownParameter: 1}", "")
    with pytest.raises(ConfigError, match="--allow-experimental-plugins"):
        Scheduler.from_config(fixed)
    scheduler = Scheduler.from_config(fixed, allow_experimental_plugins=True)
    assert [s.typed_name.name for s, _ in scheduler.profile.scorers] == [
        "session-affinity-scorer",
        "second",
        "queue-scorer",
    ]


def test_the_epp_takes_llm_d_s_flag():
    flags = ["--pool-file", "pool.yaml"]
    assert build_parser().parse_args([*flags, "--allow-experimental-plugins"]).allow_experimental_plugins
    assert not build_parser().parse_args(flags).allow_experimental_plugins


def test_a_plugin_type_must_declare_a_level():
    with pytest.raises(TypeError, match="stability"):
        register("levelless-scorer", "Beta")(type("LevellessScorer", (Scorer,), {}))
