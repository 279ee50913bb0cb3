#!/usr/bin/env bash
# Run HERE before session18_b.sh: variants/pooled = this tree with the NVLink transport's copy stream taken from
# torch's pool again (as before the fix; measurement only). Untracked; travels with the working tree.
set -eu
rm -rf variants && mkdir -p variants/pooled
git archive HEAD src tests | tar -x -C variants/pooled
python3 - <<'PY'
from pathlib import Path
p = Path("variants/pooled/src/smsplit/ep/nvlink.py")
s = p.read_text()
old = "self.copy_stream = self.ops.new_stream()"
assert s.count(old) == 1
p.write_text(s.replace(old, "self.copy_stream = torch.cuda.Stream(self.device)"))
PY
du -sh variants
