//! `capybara-kernel-http ADDR:PORT NAME`: the hostagent's HTTP service on
//! Linux kernel TCP, single-threaded like the user-space stack, so that
//! `make bench-stack` compares the two stacks with the same server code.

use capybara_hostagent::apps::serve_http_connection;
use std::rc::Rc;

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let (Some(addr), Some(name)) = (args.first(), args.get(1)) else {
        eprintln!("usage: capybara-kernel-http ADDR:PORT NAME");
        std::process::exit(2);
    };
    let addr: std::net::SocketAddr = addr.parse().unwrap_or_else(|_| {
        eprintln!("capybara-kernel-http: invalid address {addr:?}");
        std::process::exit(2)
    });
    let name: Rc<str> = Rc::from(name.as_str());
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    tokio::task::LocalSet::new().block_on(&rt, async move {
        let l = tokio::net::TcpListener::bind(addr)
            .await
            .unwrap_or_else(|e| {
                eprintln!("capybara-kernel-http: bind {addr}: {e}");
                std::process::exit(1)
            });
        loop {
            if let Ok((s, _)) = l.accept().await {
                let _ = s.set_nodelay(true);
                tokio::task::spawn_local(serve_http_connection(s, name.clone()));
            }
        }
    });
}
