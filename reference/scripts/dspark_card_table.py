"""Print the MODEL_CARD numbers of a DSpark run from its dspark_eval.json (models/k3-mini-dspark/MODEL_CARD.md):

    python3 reference/scripts/dspark_card_table.py $OUT/dspark_eval.json
"""
import json
import sys

KINDS = [("arithmetic", "arithmetic"), ("tool_use", "tool use"), ("recall", "recall"),
         ("kv_retrieval", "kv retrieval"), ("json_answer", "JSON answer"), ("prose", "prose"), ("all", "**all**")]


def cell(mode: dict, kind: str, key: str) -> str:
    v = mode.get(kind, {}).get(key)
    return "—" if v is None else f"{v:.2f}" if key == "acceptance_length" else f"{v:.3f}"


def main(path: str) -> None:
    r = json.load(open(path))
    ev, tr, cal = r.get("eval", {}), r.get("train", {}), r.get("calibration", {})
    n = ev.get("prompts_per_kind", {})
    print("| kind | prompts | greedy: acceptance length | greedy: ECE | T = 1: acceptance length | T = 1: ECE |")
    print("| --- | --- | --- | --- | --- | --- |")
    for key, name in KINDS:
        g, t = ev.get("greedy", {}), ev.get("temperature_1", {})
        print(f"| {name} | {n.get(key, sum(n.values()) if key == 'all' else '—')} | "
              f"{cell(g, key, 'acceptance_length')} | {cell(g, key, 'ece_cumulative')} | "
              f"{cell(t, key, 'acceptance_length')} | {cell(t, key, 'ece_cumulative')} |")
    for mode in ("greedy", "temperature_1"):
        a = ev.get(mode, {}).get("all", {})
        print(f"\n{mode}: prefix acceptance by position {a.get('prefix_accept_rate_by_position')}, "
              f"uncalibrated ECE {a.get('ece_cumulative_uncalibrated')}, "
              f"predicted acceptance length {a.get('mean_predicted_accept_length')}")
    print(f"\ntraining: {tr.get('steps')} steps, {tr.get('tokens_seen')} tokens, {tr.get('rows_seen')} rows, "
          f"{tr.get('train_seconds')} s, final loss (EMA) {tr.get('final_loss_ema')}")
    print(f"calibration: temperatures {cal.get('temperatures')}; ECE {cal.get('ece_cumulative_before')} -> "
          f"{cal.get('ece_cumulative_after')} on {cal.get('anchors')} anchors from {cal.get('prompts')} prompts")
    print(f"greedy lossless check: {r.get('greedy_lossless_check')}; eval {ev.get('seconds')} s; "
          f"whole run {r.get('wall_seconds')} s")
    for k in ("calibration_error", "golden_error", "eval_error"):
        if k in r:
            print(f"\n{k}:\n{r[k]}")


if __name__ == "__main__":
    main(sys.argv[1])
