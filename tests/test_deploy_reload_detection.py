"""Hot reload notices a Kubernetes ConfigMap update: a ..data symlink swapped to new files."""

from __future__ import annotations

from pathlib import Path

from gatehouse.proxy.policy import Reloader, RulesPolicy, RulesSource
from gatehouse.rules import load_rules_file
from tests.support.configmap import ConfigMapVolume

DENY_CREATE = "rules:\n  - name: a\n    deny_apis: [CreateTopics]\n"
DENY_DELETE = "rules:\n  - name: a\n    deny_apis: [DeleteTopics]\n"  # same size as above
DELETE_TOPICS = 20


def test_layout_is_the_kubelets(tmp_path: Path) -> None:
    volume = ConfigMapVolume(tmp_path / "cm")
    first = volume.publish({"rules.yaml": DENY_CREATE, "tls/tls.crt": b"x"})
    assert (volume.root / "rules.yaml").readlink() == Path("..data/rules.yaml")
    assert (volume.root / "tls").readlink() == Path("..data/tls")
    assert volume.data.readlink() == Path(first.name)
    second = volume.publish({"rules.yaml": DENY_DELETE})
    assert volume.data.readlink() == Path(second.name)
    assert not first.exists() and not (volume.root / "tls").exists()
    assert (volume.root / "rules.yaml").read_text() == DENY_DELETE


def test_symlink_swap_is_a_change_even_with_the_same_mtime_and_size(tmp_path: Path) -> None:
    volume = ConfigMapVolume(tmp_path / "cm")
    volume.publish({"rules.yaml": DENY_CREATE})
    rules_file = volume.root / "rules.yaml"
    policy = RulesPolicy(load_rules_file(rules_file))
    reloader = Reloader(policy, RulesSource(None, rules_file))
    assert not reloader.changed()

    volume.publish({"rules.yaml": DENY_DELETE}, keep_mtime=True)
    assert rules_file.stat().st_size == len(DENY_CREATE)
    assert reloader.changed()
    assert reloader.reload()
    assert not reloader.changed()
    [rule] = policy.ruleset.rules
    assert rule.deny_apis == frozenset({DELETE_TOPICS})


def test_a_vanished_file_and_its_return_are_changes(tmp_path: Path) -> None:
    volume = ConfigMapVolume(tmp_path / "cm")
    volume.publish({"rules.yaml": DENY_CREATE})
    rules_file = volume.root / "rules.yaml"
    reloader = Reloader(RulesPolicy(load_rules_file(rules_file)), RulesSource(None, rules_file))
    volume.publish({"other.yaml": "x"})
    assert reloader.changed()
    assert not reloader.reload()  # missing file: the old rules stay
    volume.publish({"rules.yaml": DENY_CREATE}, keep_mtime=True)
    assert reloader.changed()
