//! The built-in services the hostagent can serve on the user-space stack:
//! an echo service and an HTTP/1.1 service (hyper, unchanged, on the async
//! socket API). Tests and benchmarks use them.

use crate::socket::{TcpListener, TcpStream};
use bytes::Bytes;
use http_body_util::Full;
use hyper::{Request, Response};
use sha2::{Digest, Sha256};
use std::convert::Infallible;
use std::rc::Rc;
use tokio::io::AsyncWriteExt;

/// Echoes every connection; at the end of each it logs the byte count and
/// the SHA-256 of what it received, so tests can compare both ends.
pub async fn echo(listener: TcpListener) {
    loop {
        let (stream, peer) = match listener.accept().await {
            Ok(s) => s,
            Err(e) => {
                eprintln!("hostagent: echo accept: {e}");
                continue;
            }
        };
        tokio::task::spawn_local(async move {
            match echo_one(stream).await {
                Ok((n, hash)) => println!("echo peer={peer} bytes={n} sha256={hash}"),
                Err(e) => match crate::socket::moved_to(&e) {
                    Some(t) => println!("echo peer={peer} migrated to {t}"),
                    None => println!("echo peer={peer} error={e}"),
                },
            }
        });
    }
}

/// Echo that never holds a byte outside the stack: it reads only as much as
/// the send buffer can take right now and writes it back in the same step,
/// so a migration at any instant finds every byte in the TCP queues and the
/// target's echo continues exactly where this one stopped.
async fn echo_one(mut stream: TcpStream) -> std::io::Result<(u64, String)> {
    let mut buf = vec![0u8; 64 * 1024];
    let mut hash = Sha256::new();
    let mut total = 0u64;
    loop {
        let cap = std::future::poll_fn(|cx| stream.poll_send_capacity(cx)).await?;
        let want = cap.min(buf.len());
        let n = std::future::poll_fn(|cx| stream.poll_read_some(cx, &mut buf[..want])).await?;
        if n == 0 {
            break;
        }
        hash.update(&buf[..n]);
        total += n as u64;
        let written = stream.try_write(&buf[..n])?;
        debug_assert_eq!(written, n, "send capacity only grows between the two calls");
    }
    stream.shutdown().await?;
    let hex = hash.finalize().iter().map(|b| format!("{b:02x}")).collect();
    Ok((total, hex))
}

/// Serves HTTP/1.1 with keep-alive: `GET /` answers a short greeting,
/// `GET /bytes/N` answers N bytes (at most 64 MiB). Every response carries
/// `x-server: NAME`.
pub async fn http(listener: TcpListener, name: Rc<str>) {
    loop {
        let (stream, _peer) = match listener.accept().await {
            Ok(s) => s,
            Err(e) => {
                eprintln!("hostagent: http accept: {e}");
                continue;
            }
        };
        tokio::task::spawn_local(serve_http_connection(stream, name.clone()));
    }
}

/// Serves one HTTP/1.1 connection on any byte stream: the user-space
/// stack's `TcpStream`, or a kernel socket for side-by-side benchmarks.
pub async fn serve_http_connection<S>(stream: S, name: Rc<str>)
where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + 'static,
{
    let service = hyper::service::service_fn(move |req| {
        let name = name.clone();
        async move { Ok::<_, Infallible>(respond(&name, req)) }
    });
    let io = hyper_util::rt::TokioIo::new(stream);
    let _ = hyper::server::conn::http1::Builder::new()
        .keep_alive(true)
        .pipeline_flush(true)
        .serve_connection(io, service)
        .await;
}

fn respond(name: &str, req: Request<hyper::body::Incoming>) -> Response<Full<Bytes>> {
    let path = req.uri().path();
    let (status, body) = if path == "/" {
        (200, Bytes::from(format!("hello from {name}\n")))
    } else if let Some(n) = path
        .strip_prefix("/bytes/")
        .and_then(|n| n.parse::<usize>().ok())
    {
        if n <= 64 << 20 {
            (200, Bytes::from(vec![b'x'; n]))
        } else {
            (400, Bytes::from_static(b"at most 67108864 bytes\n"))
        }
    } else {
        (404, Bytes::from_static(b"not found\n"))
    };
    Response::builder()
        .status(status)
        .header("x-server", name)
        .header("content-type", "text/plain")
        .body(Full::new(body))
        .expect("static response parts are valid")
}
