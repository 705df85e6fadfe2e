"""The contract the EPP and the model servers share: metric names, the metrics parser, OpenAI request shapes,
and the EPP <-> proxy names. Neither `epp` nor `modelserver` redefines a name that lives here."""
