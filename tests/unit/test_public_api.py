"""What a definitions file imports comes from ``cmb_dagster`` alone, and loads Dagster only when used."""

import subprocess
import sys

import cmb_dagster


def test_every_root_name_resolves():
    for name in cmb_dagster.__all__:
        assert getattr(cmb_dagster, name) is not None, name


def test_importing_the_package_and_engines_does_not_load_dagster():
    code = (
        "import sys, cmb_dagster, cmb_dagster.pubsub, cmb_dagster.callbacks, cmb_dagster.ctl, "
        "cmb_dagster.reactive, cmb_dagster.triggers, cmb_dagster.cli; "
        "print(sorted(m for m in sys.modules if m.split('.')[0] == 'dagster'))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_engine_packages_export_no_internals():
    import cmb_dagster.callbacks
    import cmb_dagster.pubsub

    assert not {"read_batch", "save_watermark"} & set(cmb_dagster.pubsub.__all__)
    assert "LEASE_KIND" not in cmb_dagster.callbacks.__all__
