#!/bin/bash
f=/tmp/gitlog/$$.$RANDOM
sub=""; skip=0
for a in "$@"; do
  if [ $skip = 1 ]; then skip=0; continue; fi
  case "$a" in -c|-C|--work-tree|--git-dir) skip=1;; -*) ;; *) sub="$a"; break;; esac
done
printf '%s\t%s\t%s\n' "${PYTEST_CURRENT_TEST%% (*}" "$sub" "$PWD" > "$f"
exec /usr/bin/time -a -o "$f" -f "%U %S" /usr/bin/git "$@"
