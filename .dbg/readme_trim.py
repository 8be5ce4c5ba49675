p='README.md'; s=open(p).read()
n0=len(s.splitlines())
# A. session 4's suite note at the head of the results (the table's paragraph says which tests ran)
a0=s.index("Session 4 (2026-11-30): the whole GPU suite"); a1=s.index("NVIDIA H200, 2026-12-04 (session 39")
s=s[:a0]+s[a1:]
# B. the session paragraphs after the decode table
b0=s.index("Session 28 (bench/NOTES.md): a default plan whose register spills"); b1=s.index("Prefill (the prefill rows of the same run")
s=s[:b0]+open('.dbg/readme_b.md').read()+s[b1:]
# C. the prefill paragraph's history: keep its GEMM rates
c0=s.index("Session 21's change (its figures from session 21's run)")
c1=s.index("the GEMMs run at\n~600 TFLOP/s")
s=s[:c0]+"In session 21's run t"+s[c1+1:]
# D. the older whole-model runs: keep the layer-call note and the prompts' plan
d0=s.index("Session 38's run (`e2e-h200-2026-12-04-s38.json`)")
d1=s.index("One layer called from Python (a later run")
s=s[:d0]+"Earlier runs (`e2e-h200-*`, sessions 4–40) and what changed between them: bench/NOTES.md.\n\n"+s[d1:]
open(p,'w').write(s)
print(n0, '->', len(s.splitlines()))
