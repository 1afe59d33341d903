"""Correction flags build an AISConfig; impossible values are rejected naming the flag."""
import argparse
import re

import pytest

from megatron_ais.ais import AISConfig, registry
from megatron_ais.grpo.loss import PolicyLossConfig


def _parse(*argv):
    parser = argparse.ArgumentParser()
    AISConfig.add_flags(parser)
    PolicyLossConfig.add_flags(parser)
    return parser.parse_args(list(argv))


def test_defaults_follow_ais_method_section_2_4():
    cfg = AISConfig.from_args(_parse())
    assert (cfg.correction, cfg.level, cfg.cap, cfg.tau, cfg.lambda_min, cfg.lambda_max, cfg.ema,
            cfg.logratio_clamp) == ("ais", "token", 2.0, 0.05, 0.0, 1.0, 0.0, 20.0)
    assert (cfg.severity_exponent, cfg.reliability_exponent, cfg.variance_exponent) == (1.0, 1.0, 1.0)
    assert cfg == AISConfig()  # one source of defaults: the flags' are the dataclass's
    assert cfg.mis_band == (0.5, 2.0)
    loss = PolicyLossConfig.from_args(_parse("--clip-high", "0.3", "--loss-agg", "seq-mean-token-mean"))
    assert (loss.clip_low, loss.clip_high, loss.loss_agg) == (0.2, 0.3, "seq-mean-token-mean")


# every flag whose value names a registered choice, with the config field it sets and the names it offers
CHOICES = [
    ("--is-correction", "correction", registry.CORRECTIONS, ("none", "tis", "mis", "icepop", "ais")),
    ("--is-level", "level", None, ("token", "sequence", "geometric")),
    ("--ais-severity", "severity", registry.SEVERITY, ("mean_abs_logratio", "k3", "anchored")),
    ("--ais-reliability", "reliability", registry.RELIABILITY, ("band_ess", "raw_ess", "none")),
    ("--ais-variance", "variance", registry.VARIANCE, ("advantage_weighted", "cv", "none")),
    ("--ais-combiner", "combiner", registry.COMBINERS, ("product",)),
    ("--ais-lambda", "lambda_rule", registry.LAMBDA_RULES, ("diagnostics", "bias-test")),
    ("--kl-type", "kl_type", None, ("k1", "k3")),
    ("--loss-agg", "loss_agg", None, ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean",
                                      "seq-mean-token-sum-norm")),
]


@pytest.mark.parametrize("flag,field,table,names", CHOICES, ids=[c[0] for c in CHOICES])
def test_every_choice_is_registered(flag, field, table, names, capsys):
    parser = argparse.ArgumentParser()
    AISConfig.add_flags(parser)
    PolicyLossConfig.add_flags(parser)
    (action,) = [a for a in parser._actions if flag in a.option_strings]
    assert sorted(action.choices) == sorted(names)
    if table is not None:
        assert sorted(table) == sorted(names)
    for name in names:
        args = _parse(flag, name)
        config = AISConfig.from_args(args) if hasattr(AISConfig(), field) else PolicyLossConfig.from_args(args)
        assert getattr(config, field) == name, (flag, name)
    with pytest.raises(SystemExit):
        _parse(flag, "no-such-choice")
    assert "invalid choice: 'no-such-choice'" in capsys.readouterr().err


@pytest.mark.parametrize("field,flag", [("correction", "--is-correction"), ("severity", "--ais-severity"),
                                        ("reliability", "--ais-reliability"), ("variance", "--ais-variance"),
                                        ("combiner", "--ais-combiner")])
def test_unregistered_names_are_refused_at_construction(field, flag):
    """Names are checked against the registries when the config is built, not only by argparse's choices."""
    with pytest.raises(ValueError, match=f"{flag} 'bogus' must be one of"):
        AISConfig(**{field: "bogus"})


def test_help_lists_the_registered_names():
    parser = argparse.ArgumentParser()
    AISConfig.add_flags(parser)
    text = parser.format_help()
    assert "--is-correction {none,tis,mis,icepop,ais}" in text
    for table in (registry.SEVERITY, registry.RELIABILITY, registry.VARIANCE, registry.COMBINERS):
        assert f"{table.title} {{{','.join(sorted(table))}}}" in text


@pytest.mark.parametrize("argv,message", [
    (["--is-cap", "1.0"], "--is-cap 1.0 must be > 1 (the band [1/C, C] must be non-empty)"),
    (["--ais-tau", "0"], "--ais-tau 0.0 must be > 0"),
    (["--ais-lambda-min", "0.8", "--ais-lambda-max", "0.5"], "--ais-lambda-min 0.8"),
    (["--ais-ema", "1.0"], "--ais-ema 1.0 must be in"),
    (["--is-mask-low", "3.0"], "--is-mask-low/--is-mask-high"),
    (["--icepop-low", "6"], "--icepop-low 6.0 must be below --icepop-high"),
])
def test_bad_values_name_the_flag(argv, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        AISConfig.from_args(_parse(*argv))
