# sgl-ecospec on the SGLang release image of the pinned version (requirements.txt:
# sglang==0.5.23). Build and run: docs/deploy.md.
#
# The image's own sglang, torch and CUDA toolkit are kept. scripts/docker_install.sh builds
# sgl_ecospec._C with its CUDA kernels (SGL_ECOSPEC_CUDA=1 makes a missing toolkit an error;
# setup.py compiles them for sm_90, H100/H200), installs the package and its SGLang plugin
# entry point into the image's python3, and checks that the plugin registers ECOSPEC. CI runs
# the same script outside Docker (test/deploy/test_deploy.py); the image itself is not built in CI.
FROM lmsysorg/sglang:v0.5.23

LABEL org.opencontainers.image.title="sgl-ecospec" \
      org.opencontainers.image.description="SGLang 0.5.23 with the ECOSPEC speculative algorithm" \
      org.opencontainers.image.base.name="lmsysorg/sglang:v0.5.23"

# Parallel compile jobs for the extension.
ARG MAX_JOBS=8

WORKDIR /sgl-workspace/sgl-ecospec
COPY . .
RUN MAX_JOBS="${MAX_JOBS}" SGL_ECOSPEC_CUDA=1 bash scripts/docker_install.sh

# `python3 -m` puts the working directory first on sys.path: started in the source tree, the
# server would import sgl_ecospec from there, which has no compiled extension.
WORKDIR /sgl-workspace
EXPOSE 30000
