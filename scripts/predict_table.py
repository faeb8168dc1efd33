#!/usr/bin/env python3
"""Predicted against measured, one Markdown row a plan, from `strata-exec bench --format json`
lines that carry a "run" key (the plan's name): pp512 and tg128 measured / predicted, the
expert cache's hit rate measured / predicted, and the bytes streamed a prefill.
Usage: scripts/predict_table.py FILE.jsonl"""
import json
import sys

print("| plan | pp512 measured / predicted | tg128 measured / predicted "
      "| hit measured / predicted | GB streamed a prefill |")
print("| --- | --- | --- | --- | --- |")
for line in open(sys.argv[1]):
    j = json.loads(line)
    p, e = j["predicted"], j.get("experts") or {}
    pp, tg = j["prefill_tok_s"]["mean"], j["decode_tok_s"]["mean"]
    hit = e.get("hit_rate")
    print(f"| {j['run']} | {pp:.0f} / {p['prefill_tok_s']:.0f} ({pp / p['prefill_tok_s']:.2f}) | "
          f"{tg:.1f} / {p['decode_tok_s']:.1f} ({tg / p['decode_tok_s']:.2f}) | "
          f"{'-' if hit is None else f'{hit:.3f}'} / {e.get('predicted_hit_rate', 1.0):.3f} | "
          f"{e.get('pcie_bytes_per_prefill', 0) / 1e9:.2f} |")
