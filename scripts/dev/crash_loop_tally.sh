#!/usr/bin/env bash
# Runs / failures per configuration from scripts/dev/crash_loop.sh's results.tsv (markdown rows).
#   scripts/dev/crash_loop_tally.sh OUTDIR/results.tsv [EXCLUDED_RUN_INDEX...]
# Excluded runs (set-up errors, runs killed by hand) are left out of the counts.
f=${1:?results.tsv}; shift
awk -F'\t' -v ex="$*" '
  BEGIN { n = split(ex, e, " "); for (i = 1; i <= n; i++) skip[e[i]] = 1 }
  NR == 1 || ($1 in skip) { next }
  { runs[$2]++; secs[$2] += $4; if ($5 != "ok") { fail[$2]++; kinds[$2] = kinds[$2] " " $5 "(rc " $3 ")" } }
  END {
    print "| configuration | runs | failures | kinds | mean s/run |"
    print "|---|---|---|---|---|"
    for (c in runs) { tr += runs[c]; tf += fail[c]
      printf "| %s | %d | %d | %s | %.0f |\n", c, runs[c], fail[c] + 0, (kinds[c] == "" ? "-" : kinds[c]), secs[c] / runs[c] }
    printf "| **all** | %d | %d | | |\n", tr, tf
  }' "$f"
