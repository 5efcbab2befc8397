#!/usr/bin/env bash
# Builds the dashboard into web-ui/dist/ (index.html, app.js, app.css), which
# the api serves at `/`. Uses Debian's node packages (node-react, node-react-dom,
# node-chart.js, esbuild, node-typescript) under /usr/share/nodejs; with an npm
# install (package.json, same versions) web-ui/node_modules is used instead.
#   build.sh            typecheck (tsc) + bundle (esbuild, minified)
#   build.sh --no-check bundle only
set -euo pipefail
cd "$(dirname "$0")"
check=1
[[ "${1:-}" == "--no-check" ]] && check=0

debian=/usr/share/nodejs
# tsc resolves modules through node_modules only; link Debian's packages there
# unless npm installed them.
if [[ ! -d node_modules || -f node_modules/.debian-links ]]; then
    mkdir -p node_modules/@types node_modules/@kurkle
    for pkg in react react-dom scheduler chart.js @kurkle/color \
               @types/react @types/react-dom @types/scheduler; do
        if [[ ! -e "$debian/$pkg" ]]; then
            echo "build.sh: missing $debian/$pkg (apt-get install node-react node-react-dom node-chart.js node-typescript esbuild)" >&2
            exit 2
        fi
        ln -sfn "$debian/$pkg" "node_modules/$pkg"
    done
    touch node_modules/.debian-links
fi

if (( check )); then
    tsc --noEmit -p .
fi

rm -rf dist.tmp
mkdir -p dist.tmp
# SOURCEMAP=1 adds app.js.map for debugging.
sourcemap=()
[[ "${SOURCEMAP:-0}" == 1 ]] && sourcemap=(--sourcemap)
NODE_PATH="$debian" esbuild src/main.tsx --bundle --minify "${sourcemap[@]}" \
    --target=es2019 --format=iife --jsx=automatic \
    --define:process.env.NODE_ENV='"production"' \
    --outfile=dist.tmp/app.js --log-level=warning
cp src/app.css dist.tmp/app.css
cp src/index.html dist.tmp/index.html
# Swap in atomically so a running api never serves a half-written dist/.
rm -rf dist.old
[[ -d dist ]] && mv dist dist.old
mv dist.tmp dist
rm -rf dist.old
echo "build.sh: built $(pwd)/dist ($(du -sk dist | cut -f1) KiB)"
