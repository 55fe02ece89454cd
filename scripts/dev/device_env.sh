# Sourced by the device scripts, from the checkout root, in place of `source .gpu-bundle/setup.sh`: the bundle's
# setup (its wheels installed into /tmp/site, the flashinfer JIT cache restored into ~/.cache), then the installed
# packages dated back to 2000-01-01 so that the carried cache is used.
#
# Why: flashinfer runs ninja before it loads any JIT module, and ninja rebuilds a module when one of its inputs is
# newer than its outputs. pip gives the headers and sources it installs (flashinfer's csrc and include, tvm_ffi's)
# the time of the install, which is newer than every object in the carried cache, so on each fresh machine, and at
# each later `source` of setup.sh on the same machine, flashinfer would compile every module again, over a minute of
# an engine's start. Touching the cache's objects instead would not do: ninja then finds its dependency log older
# than the objects and rebuilds as well.
# The bundle: FLOTILLA_BUNDLE, else .gpu-bundle, else the slim .gpu-lite (no flashinfer) that a run carrying one of
# the vLLM peer's parts takes instead
_bundle=${FLOTILLA_BUNDLE:-$([ -f .gpu-bundle/setup.sh ] || [ ! -f .gpu-lite/setup.sh ] && echo .gpu-bundle || echo .gpu-lite)}
source "$_bundle/setup.sh"
unset _bundle
# Optional extras beside the bundle (.gpu-extra/*.whl, git-ignored): flash-linear-attention's chunked prefill for
# Qwen3.5's delta nets, which the GPU tests then check against transformers. Build it here with
#   python3 -m pip download --no-deps -d .gpu-extra fla-core==0.6.0 einops==0.8.2
# and carry ".gpu-extra" beside ".gpu-bundle".
if compgen -G ".gpu-extra/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/extra \
    --root-user-action=ignore .gpu-extra/*.whl && export PYTHONPATH=/tmp/extra${PYTHONPATH:+:$PYTHONPATH}
fi
_site=${FLOTILLA_BUNDLE_SITE:-/tmp/site}   # where setup.sh installs the wheels (a test points it elsewhere)
[ -d "$_site" ] && find "$_site" -exec touch -h -d 2000-01-01 {} + 2>/dev/null
unset _site
true
