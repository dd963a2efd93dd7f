"""What the diffusers benchmarks share: their command line (variants, image size, steps, repeats, device, the --tiny
smoke mode, the compile backend) and the loop over variants."""
import argparse
import json

from report import add_speedups, write_report


def parser_for(doc: str, variants: tuple, model: str, tiny_res: int) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--variants", default=",".join(variants), help=f"comma-separated, from {', '.join(variants)}")
    parser.add_argument("--res", type=int, default=None,
                        help=f"image side in pixels (default 1024; --tiny: {tiny_res})")
    parser.add_argument("--steps", type=int, default=None, help="sampling steps (default 20; --tiny: 4)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repeats", type=int, default=None, help="timed runs per variant (--tiny: 1)")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tiny", action="store_true", help=f"a tiny {model}: smoke test of the script")
    parser.add_argument("--backend", default=None, help="torch.compile backend for the peer and Overdrive (default "
                        "inductor; --tiny on the CPU: eager, i.e. Dynamo without Inductor's slow C++ compiles)")
    parser.add_argument("--out", default=None, help="JSON report path")
    return parser


def settle(parser: argparse.ArgumentParser, args, variants: tuple, tiny_res: int, repeats: int, named=()):
    """Defaults that depend on --tiny and --device; the variants as a list (and `named`, other variant lists), each
    checked against `variants`."""
    defaults = ({"res": tiny_res, "steps": 4, "repeats": 1} if args.tiny
                else {"res": 1024, "steps": 20, "repeats": repeats})
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.backend is None:
        args.backend = "eager" if args.tiny and args.device == "cpu" else "inductor"
    args.variants = args.variants.split(",")
    unknown = sorted(set(args.variants + [v for name in named for v in (getattr(args, name) or [])]) - set(variants))
    if unknown:
        parser.error(f"unknown variants {unknown}; choose from {', '.join(variants)}")
    return args


def run_variants(report: dict, variants: list, run, reset, out) -> list:
    """`run(variant, reference) -> (row, reference)` for each variant in the order given, the row printed and the
    report written after each (a run stopped at its time limit keeps what it measured), `reset()` between them."""
    rows, reference = report["results"], None
    for variant in variants:
        row, reference = run(variant, reference)
        rows.append(row)
        print(json.dumps(row), flush=True)
        add_speedups([r for r in rows if "s_per_image" in r])
        write_report(report, out)
        reset()
    return rows
