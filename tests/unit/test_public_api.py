"""What a definitions file imports comes from ``cmb_dagster`` alone, and loads Dagster only when used."""

import json
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


def test_a_command_loads_only_its_own_engine():
    engines = ["callbacks", "ctl", "eventqueue", "pubsub", "reactive", "stages", "metrics"]
    code = (
        "import atexit, json, sys; from cmb_dagster.cli import run; "
        "loaded = lambda: sorted({m.split('.')[1] for m in sys.modules if m.startswith('cmb_dagster.')}); "
        "atexit.register(lambda: print(json.dumps(loaded()), file=sys.stderr)); run()"
    )
    # stages uses pub/sub (an entity's changes are published), never the others
    for args, used in ((["db", "url"], set()), (["--bogus"], set()), (["stages", "--help"], {"stages", "pubsub"})):
        out = subprocess.run(
            [sys.executable, "-c", code, *args],
            capture_output=True,
            text=True,
            timeout=60,
            env={"CMB_DATABASE_URL": "postgresql://u@127.0.0.1:1/d", "PATH": ""},
        )
        loaded = set(json.loads(out.stderr.strip().splitlines()[-1]))
        assert {e for e in engines if e in loaded} == used, (args, loaded)


def test_engine_packages_export_no_internals():
    import cmb_dagster.callbacks
    import cmb_dagster.pubsub

    assert not {"read_batch", "save_watermark"} & set(cmb_dagster.pubsub.__all__)
    assert "LEASE_KIND" not in cmb_dagster.callbacks.__all__
