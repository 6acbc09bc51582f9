"""The report's attribute section: which training rows broke a behaviour (the attribute stage's result).

    collect_attribute(path) -> a JSON-able view of <run dir>/attribute.json, read by its checking reader
    attribute_section(view) -> the section's HTML

The section is text only, every value escaped (`markup.esc` / `markup.table`), and nothing of it goes
into the page's data block: a prompt, an answer or a training row that holds markup or a script
opener is shown as written and stays inert. What it shows: the regression with its interval, the
flipped items with what the tuned model now says, the base-model blame, the engines' agreement,
the clusters of the accused rows with their share, terms, shared `gradian diagnose` findings and
rows, the sentences of the long accused rows, and `--verify`'s retrains when the result has them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from circuitkit_app.report.markup import Raw, esc, table

SHOWN_ITEMS = 100  # flipped items listed (all are in attribute.json)
SHOWN_ROWS = 50  # accused rows listed per cluster, and in the list of a result without clusters


def collect_attribute(path: Path) -> dict[str, Any]:
    """The result at `path` as the section shows it (UserError from the reader when it is not one)."""
    from gradian.attribute.result import read_result

    r = read_result(path)
    flipped = [it for it in r.items if it["flipped"]]
    return {"file": str(path), "attributed": r.attributed, "reason": r.reason, "eval_dataset": r.eval_dataset,
            "models": r.models, "query": r.query, "engines": r.engines, "damping": r.damping, "seeds": r.seeds,
            "regression": r.regression, "base_blame": r.base_blame, "n_flipped": len(flipped),
            "flipped": flipped[:SHOWN_ITEMS], "top_k": r.top_k, "accused": r.accused, "agreement": r.agreement,
            "clusters": r.clusters, "clusters_note": r.clusters_note, "spans": r.spans, "verify": r.verify,
            "clusters_method": r.clusters_method, "lessons": r.lessons,
            "wall_s": r.wall_s}


def _ci(value: float, ci: list[float], digits: int = 3) -> str:
    return f"{value:+.{digits}f} [{ci[0]:+.{digits}f}, {ci[1]:+.{digits}f}]"


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.0f} %"


def _regression(v: dict[str, Any]) -> str:
    r = v["regression"]
    conf = f"{100 * r['confidence']:g} % CI"
    rows = [["accuracy (greedy reproduces the answer)", f"base {r['base_accuracy']:.3f} → tuned {r['tuned_accuracy']:.3f}"],
            [f"accuracy drop ({conf})", _ci(r["accuracy_drop"], r["accuracy_ci"])],
            [f"answer log-prob drop, nats ({conf})", _ci(r["logprob_drop"], r["logprob_ci"], 2)],
            ["first-token accuracy", f"base {r['base_first_token_accuracy']:.3f} → tuned"
                                     f" {r['tuned_first_token_accuracy']:.3f}"],
            ["flipped right → wrong", f"{len(r['flipped'])} (wrong → right: {len(r['fixed'])})"],
            ["bootstrap", f"{r['resamples']} paired resamples over {r['n_items']} items, seed {r['seed']}"]]
    return table(["", ""], rows)


def _how(v: dict[str, Any]) -> str:
    tuned, base, q = v["models"]["tuned"], v["models"]["base"], v["query"]
    adapter = tuned.get("adapter") or {}
    tuned_text = tuned["name"] + (f" with the LoRA adapter {adapter.get('name') or adapter.get('path')}" if adapter
                                  else "")
    damping = ", ".join(f"{e} {d:.3g}" for e, d in v["damping"].items() if isinstance(d, (int, float)))
    rows = [["eval set", v["eval_dataset"]], ["tuned model", tuned_text],
            ["base model", f"{base['name']} ({base.get('how')})"],
            ["query loss", q.get("query_loss")], ["engines (the first accuses)", ", ".join(v["engines"])
                                                  + (f"; damping {damping}" if damping else "")],
            ["seeds", ", ".join(f"{k} {s}" for k, s in v["seeds"].items())],
            ["result", f"{v['file']} ({v['wall_s']:.1f} s)"]]
    return table(["", ""], rows)


def _flipped(v: dict[str, Any]) -> str:
    rows = [[it["line"], it["prompt"], repr(it["answer"]), repr(it["tuned_says"]) if it["tuned_says"] is not None
             else "-", f"{it['base']['margin']:.2f}", f"{it['base']['logprob']:.2f} → {it['tuned']['logprob']:.2f}"]
            for it in v["flipped"]]
    shown = f"first {len(rows)} of {v['n_flipped']}" if v["n_flipped"] > len(rows) else f"{len(rows)}"
    body = table(["line", "prompt", "answer", "tuned says", "base margin", "answer log-prob"], rows, {0, 4, 5},
                 row_class=["flipped"] * len(rows))
    return f"<h3>Flipped items ({esc(shown)})</h3>{body}"


def _rows_table(rows: list[dict[str, Any]]) -> str:
    return table(["rank", "row", "line", "score", "training row"],
                 [[a["rank"], a["row_id"], "-" if a["line"] is None else a["line"], f"{a['score']:.4g}",
                   a["text_preview"] if a["text_preview"] is not None else "(training data not available)"]
                  for a in rows[:SHOWN_ROWS]], {0, 1, 2, 3})


def _more(n: int) -> str:
    return f'<p class="note">… {n - SHOWN_ROWS} more in the result file</p>' if n > SHOWN_ROWS else ""


def _clusters(v: dict[str, Any]) -> str:
    accused = {a["row_id"]: a for a in v["accused"]}
    method = v.get("clusters_method") or "tfidf"
    by = "TF-IDF" if method == "tfidf" else f"sentence embeddings and HDBSCAN ({method.split(':', 1)[-1]})"
    parts = [f"<h3>Clusters of the accused rows (by {esc(by)})</h3><p class=note>Each cluster's share of the accused"
             " rows' summed (negative) score, its top TF-IDF terms, the <code>gradian diagnose</code> findings its rows"
             " share, and its rows.</p>"]
    for c in v["clusters"]:
        findings = "".join(f"<li>{esc(f['text'])}</li>" for f in c["findings"])
        rows = sorted((accused[r] for r in c["rows"] if r in accused), key=lambda a: a["rank"])
        parts.append(f'<details open class="cluster"><summary>cluster {esc(c["cluster"])}: {100 * c["share"]:.1f} % of'
                     f' the accusation, {esc(c["n_rows"])} rows; terms: {esc(", ".join(c["top_terms"]) or "-")}'
                     f'</summary>{f"<ul>{findings}</ul>" if findings else "<p class=note>no shared diagnose finding</p>"}'
                     f"{_rows_table(rows)}{_more(len(rows))}</details>")
    return "".join(parts)


def _lessons(lessons: list[dict[str, Any]]) -> str:
    """The lessons (the accused rows grouped by the template they teach) and, for a main lesson, the
    rows teaching it that were not accused."""
    rows = [[d["lesson"], f"{100 * d['share']:.1f} %", d["n_rows"], ", ".join(map(str, d["clusters"])) or "-",
             d["template"], d["said"]] for d in lessons]
    parts = ["<h3>Lessons: the accused rows grouped by the answer template they teach</h3><p class=note>Completions"
             " with entities masked (numbers, names, quoted strings); rows of one template in several phrasings"
             " are one lesson.</p>" + table(["lesson", "share", "rows", "clusters", "template", "in words"], rows,
                                            {0, 1, 2})]
    for d in lessons:
        same = d.get("same_lesson")
        if same and same["rows"]:
            parts.append(f"<h4>Rows teaching lesson {esc(d['lesson'])}, not accused</h4><p class=note>{esc(same['said'])};"
                         " most negative score first.</p>"
                         + table(["row", "line", "score", "text"], [[r["row_id"], r["line"], f"{r['score']:.4g}",
                                                                    r["text_preview"]] for r in same["rows"]], {0, 1, 2}))
    return "".join(parts)


def _spans(spans: dict[str, Any]) -> str:
    rows = []
    for r in spans["rows"]:
        top = r["sentences"][r["top"]]
        rows.append([r["row_id"], "-" if r["line"] is None else r["line"], len(r["sentences"]), _pct(top["share"]),
                     f"{top['token_span'][0]}-{top['token_span'][1]}", top["text"]])
    return (f"<h3>Where the blame sits in the long accused rows</h3><p class=note>Rows with at least"
            f" {esc(spans['min_tokens'])} supervised tokens, one gradient per sentence; the sentence of most negative"
            f" {esc(spans['engine'])} score and its share of the row's.</p>"
            + table(["row", "line", "sentences", "share", "tokens", "sentence"], rows, {0, 1, 2, 3}))


def _verify(verify: dict[str, Any]) -> str:
    s = verify["settings"]
    length = f"{s['steps']} steps" if s["steps"] is not None else f"{s['epochs']} epochs"
    how = f"{s['kind']}, lr {s['lr']:g}, {length}, batch {s['batch_size']}, seed {s['seed']}"
    rows = [[name, "-", f"{verify['reference'][name]['accuracy']:.3f}", f"{verify['reference'][name]['logprob_mean']:.2f}",
             "100 %" if name == "base" else "0 %", "100 %" if name == "base" else "0 %", "-", "-"]
            for name in ("base", "tuned")]
    rows += [[r["label"], r["rows_trained"], f"{r['accuracy']:.3f}", f"{r['logprob_mean']:.2f}",
              _pct(r["recovered_accuracy"]), _pct(r["recovered_logprob"]), f"{r['flipped_right_again']} of {r['flipped']}",
              f"{r['flipped_same_mistake']} of {r['flipped']}"] for r in verify["runs"]]
    body = table(["model", "rows", "accuracy", "answer log-prob", "recovered (accuracy)", "recovered (log-prob)",
                  "flipped items right again", "same mistake as tuned"], rows, {1, 2, 3, 4, 5}) if verify["runs"] else ""
    return (f"<h3>Verify: the fine-tune redone ({esc(how)}) on {esc(verify['rows'])} rows</h3>{body}"
            f"<p>{esc(verify['summary'])}</p>")


def attribute_section(v: dict[str, Any]) -> str:
    """The section's HTML (every value escaped)."""
    parts = ['<section id="attribute"><h2>Attribute: which training rows broke the behaviour</h2>',
             _how(v), "<h3>The regression</h3>", _regression(v), f"<p>{esc(v['reason'])}</p>"]
    if not v["attributed"]:
        parts.append(f'<p class="warn">Nothing attributed: {esc(v["reason"])}</p>')
    else:
        parts += [_flipped(v), f"<p>{esc(v['base_blame']['summary'])}</p>"]
        for a in v["agreement"]:
            rho = "n/a" if a["spearman"] is None else f"{a['spearman']:.3f}"
            flag = Raw(' <span class="warn">low confidence: the engines disagree on the accused rows</span>'
                       if a["low_confidence"] else "")
            parts.append(f"<p>agreement {esc(a['against'])} vs {esc(a['engine'])}: top-{esc(a['k'])} overlap"
                         f" {a['top_k_overlap']:.2f}, Spearman {esc(rho)}{flag}</p>")
        if v["clusters"]:
            parts.append(_clusters(v))
        else:
            parts.append(f"<h3>Accused training rows ({esc(len(v['accused']))}, most negative score first)</h3>"
                         f"{_rows_table(v['accused'])}{_more(len(v['accused']))}")
        if v["clusters_note"]:
            parts.append(f'<p class="note">{esc(v["clusters_note"])}</p>')
        if v.get("lessons"):
            parts.append(_lessons(v["lessons"]))
        if v["spans"] and v["spans"]["rows"]:
            parts.append(_spans(v["spans"]))
        if v["spans"] and v["spans"].get("note"):
            parts.append(f'<p class="note">{esc(v["spans"]["note"])}</p>')
    if v["verify"] is not None:
        parts.append(_verify(v["verify"]))
    parts.append("</section>")
    return "".join(parts)
