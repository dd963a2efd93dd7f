"""Keep every workflows/X_api.json's UI twin workflows/X.json in step with it.

Writes X.json where it is missing, or where converting it the way ComfyUI's "Queue Prompt" does no longer gives
the API file's graph; a UI file that still converts exactly (e.g. one rearranged by hand) is left as it is.
The node definitions come from a real ComfyUI: the one at --url, else one started here on loopback.

    python3 scripts/make_ui_workflows.py [--url http://127.0.0.1:8188] [--check]
"""
import argparse
import json
import sys
import tempfile

from overdrive.harness import ComfyClient, ComfyServer
from overdrive.harness.workflow_formats import api_to_ui, ui_to_api, ui_twin, without_meta
from overdrive.harness.workflows import WORKFLOWS


def in_step(api_path, object_info) -> bool:
    ui_path = ui_twin(api_path)
    if not ui_path.is_file():
        return False
    api = json.loads(api_path.read_text())
    try:
        return without_meta(ui_to_api(json.loads(ui_path.read_text()), object_info)) == without_meta(api)
    except ValueError:  # e.g. a node gained a widget since the UI file was written
        return False


def unknown_types(api_path, object_info) -> set:
    return {node["class_type"] for node in json.loads(api_path.read_text()).values()} - set(object_info)


def sync(object_info, check_only=False) -> list:
    """The API files whose UI twin was (or, with check_only, would be) written."""
    stale = []
    for path in sorted(WORKFLOWS.glob("*_api.json")):
        if unknown_types(path, object_info):
            print(f"skipped {path.name}: this server has no {sorted(unknown_types(path, object_info))}")
        elif not in_step(path, object_info):
            stale.append(path)
    for path in stale if not check_only else ():
        ui = api_to_ui(json.loads(path.read_text()), object_info)
        ui_twin(path).write_text(json.dumps(ui, indent=2) + "\n")
    return stale


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", help="a running ComfyUI with Overdrive (default: start one)")
    parser.add_argument("--check", action="store_true", help="only report; exit 1 if a UI file is missing or stale")
    args = parser.parse_args()
    if args.url:
        stale = sync(ComfyClient(args.url).object_info(), args.check)
    else:
        with tempfile.TemporaryDirectory() as workdir, ComfyServer(workdir) as server:
            stale = sync(ComfyClient(server.url).object_info(), args.check)
    for path in stale:
        print(f"{'stale' if args.check else 'wrote'} {ui_twin(path).relative_to(WORKFLOWS.parent)}")
    sys.exit(1 if stale and args.check else 0)


if __name__ == "__main__":
    main()
