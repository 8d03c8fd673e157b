#!/usr/bin/env bash
# A command's --help, --version and refusal of an unknown option:
#   check_help.sh COMMAND [MARKDOWN]
# --help exits 0 and names every option of the command's table (as
# --help-markdown lists them, or the file MARKDOWN holds: the test
# cli_tables writes it, saving a start of the command); --version names tessera;
# --no-such-option exits non-zero naming itself and the closest valid option.
set -uo pipefail
cmd=$1
help=$("$cmd" --help) || { echo "FAIL: $cmd --help exited $?"; exit 1; }
if [ -n "${2:-}" ]; then
  md=$(cat "$2") || { echo "FAIL: no $2 (the test cli_tables writes it)"; exit 1; }
else
  md=$("$cmd" --help-markdown) || { echo "FAIL: $cmd --help-markdown exited $?"; exit 1; }
fi
names=$(grep -o '^| `[^ `]*' <<<"$md" | sed 's/^| `//')
[ -n "$names" ] || { echo "FAIL: $cmd lists no options"; exit 1; }
count=0
for n in $names; do
  grep -qF -- "$n" <<<"$help" || { echo "FAIL: $cmd --help does not name $n"; exit 1; }
  count=$((count + 1))
done
"$cmd" --version | grep -q "tessera " || { echo "FAIL: $cmd --version"; exit 1; }
err=$("$cmd" --no-such-option 1 2>&1) && { echo "FAIL: $cmd accepted --no-such-option"; exit 1; }
grep -q "unknown flag --no-such-option; the closest valid one is --" <<<"$err" ||
  { echo "FAIL: $cmd's refusal does not name the closest option: $err"; exit 1; }
echo "$cmd: --help names all $count options; --version; unknown options refused"
