"""``depthmem variants``: list every registered depth mixer with its knobs."""

from __future__ import annotations

import json


def add_parser(sub):
    p = sub.add_parser(
        "variants",
        help="list depth-mixing variants, their knobs and allowed values",
        description="List every registered depth mixer with its knobs, allowed values and defaults.",
    )
    p.add_argument("--json", action="store_true", help="print machine-readable JSON")
    p.add_argument("--costs", action="store_true", help="print the cost model of every variant for a preset")
    p.add_argument("--preset", default="small", help="model preset for --costs (default: small)")
    p.add_argument("--depth", type=int, help="--costs: sublayers of the roofline (default: the preset's)")
    p.add_argument("--width", type=int, help="--costs: model width of the roofline (default: the preset's)")
    p.add_argument("--seq", type=int, help="--costs: context of the roofline (default: the preset's)")
    p.add_argument("--dtype", default="float32", help="--costs: depth state's dtype, float32 or bf16")
    return p


def describe_costs(table) -> str:
    """The cost table for a reader: counts with their units and SI prefixes, shares of PreLN as percentages."""
    from harness import units
    from harness.sweeps.jobstate import format_rows

    rows = [
        {
            "variant": r.variant,
            "params added": units.si(r.params_added),
            "of PreLN": f"+{units.percent(r.params_added_frac)}",
            "depth state / token": f"{r.stream_floats_per_token:,} floats",
            "FLOPs added / token": units.si(r.extra_flops_per_token),
            "of PreLN ": f"+{units.percent(r.extra_flops_frac)}",
            "sizes at its defaults": ", ".join(f"{k} {v}" for k, v in r.sizes.items()),
        }
        for r in table.itertuples()
    ]
    a = table.attrs
    head = (
        f"cost over PreLN at the {a['preset']} preset (PreLN: {units.si(a['preln_params'])} parameters, "
        f"{units.si(a['preln_flops_per_token'])} forward FLOPs per token at full context); --json gives the raw numbers"
    )
    return head + "\n" + format_rows(rows, list(rows[0]) if rows else [])


def run(args) -> int:
    # Imported here, not at the top, so the CLI starts without loading torch, pandas or lm-eval.
    import variants

    if args.costs:
        from harness.model.costs import cost_table
        from harness.model.roofline import describe_roofline, resized, roofline_table

        table = cost_table(args.preset)
        model = resized(args.preset, args.depth, args.width)
        roof = roofline_table(model, seq_len=args.seq, dtype=args.dtype)
        if args.json:
            print(json.dumps({"costs": table.to_dict(orient="records"), "roofline": roof.to_dict(orient="records")}))
        else:
            print(describe_costs(table) + "\n\n" + describe_roofline(roof))
        return 0
    info = variants.describe()
    if args.json:
        print(json.dumps(info, indent=2))
        return 0
    for v in info:
        print(f"{v['name']}: {v['description']}")
        rows = [(k["knob"], k["default"], k["allowed"], k["help"]) for k in v["knobs"]]
        if rows:
            widths = [max(len(r[i]) for r in rows + [("knob", "default", "allowed", "")]) for i in range(3)]
            print("    " + "  ".join(h.ljust(w) for h, w in zip(("knob", "default", "allowed"), widths)) + "  meaning")
            for r in rows:
                print("    " + "  ".join(c.ljust(w) for c, w in zip(r, widths)) + "  " + r[3])
        print()
    return 0
