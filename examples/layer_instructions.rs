//! Sends requests one after the other through `QuotaLayer::daily` (memory
//! store, subject from `x-account-id`) around a service that answers at
//! once, or through that bare service: run under valgrind's callgrind by
//! `scripts/layer-instructions.sh`, which takes the difference between two
//! request counts, so that start-up and exit cancel out and what remains is
//! the instructions of one request.
//!
//! `layer_instructions <bare|layer|floor> <requests> [subjects]`: each
//! request is built with the `x-account-id` header of one of `subjects`
//! (default 1) in turn, as `benches/layer.rs` builds them. `floor` is the
//! floor of a quota layer of that bench, written by hand
//! (`shared/floor_layer.rs`): what any layer that counts and tells spends.

use std::convert::Infallible;

use http::{HeaderValue, Request, Response};
use tower::{service_fn, Layer, Service, ServiceExt};
use tower_quota::{FromHeader, QuotaLayer};

#[path = "shared/floor.rs"]
mod floor;
#[path = "shared/floor_layer.rs"]
mod floor_layer;

async fn trivial(_: Request<()>) -> Result<Response<String>, Infallible> {
    Ok(Response::new(String::new()))
}

fn usage() -> ! {
    eprintln!("usage: layer_instructions <bare|layer|floor> <requests> [subjects]");
    std::process::exit(2)
}

async fn send<S>(mut service: S, requests: u64, ids: &[HeaderValue])
where
    S: Service<Request<()>>,
    S::Error: std::fmt::Debug,
{
    for i in 0..requests {
        let id = &ids[(i % ids.len() as u64) as usize];
        let mut request = Request::new(());
        request.headers_mut().insert("x-account-id", id.clone());
        let ready = service.ready().await.expect("ready");
        let response = ready.call(request).await.expect("answered");
        std::hint::black_box(response);
    }
}

fn main() {
    let mut args = std::env::args().skip(1);
    let mode = args.next().unwrap_or_else(|| usage());
    let requests: u64 = args
        .next()
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| usage());
    let subjects: u64 = args
        .next()
        .map_or(Some(1), |n| n.parse().ok())
        .unwrap_or_else(|| usage());
    let ids: Vec<HeaderValue> = (0..subjects.max(1))
        .map(|i| HeaderValue::try_from(format!("account-{i:06}")).expect("a valid id"))
        .collect();
    let runtime = tokio::runtime::Builder::new_current_thread()
        .build()
        .expect("a runtime");
    runtime.block_on(async {
        match mode.as_str() {
            "bare" => send(service_fn(trivial), requests, &ids).await,
            "layer" => {
                let layer = QuotaLayer::daily(1 << 40, FromHeader::account("x-account-id"));
                send(layer.layer(service_fn(trivial)), requests, &ids).await
            }
            "floor" => send(floor_layer::Floor::new(service_fn(trivial)), requests, &ids).await,
            _ => usage(),
        }
    });
}
