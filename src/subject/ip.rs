use std::borrow::Cow;
use std::collections::VecDeque;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};

use http::header::{HeaderName, FORWARDED};
use http::request::Parts;
use ipnet::{IpNet, Ipv4Net, Ipv6Net};

use super::{Subject, SubjectError, SubjectExtractor, SubjectKind};

/// The most proxy hops read from the right of a forwarding header.
const MAX_HOPS: usize = 64;

static X_FORWARDED_FOR: HeaderName = HeaderName::from_static("x-forwarded-for");

/// Charges the client's IP address, or its IPv6 network: kind
/// [`SubjectKind::IP`].
///
/// # Where the address comes from
///
/// The peer address of the connection, from the request extensions:
/// axum's `ConnectInfo<SocketAddr>` (with the `axum` feature, on by default;
/// serve the app with `into_make_service_with_connect_info::<SocketAddr>()`),
/// else a [`SocketAddr`], else an [`IpAddr`] that your own server inserted
/// (tonic's server inserts none of them: see the crate's gRPC section for
/// the layer that copies its peer address in). A
/// request with none of them is [`SubjectError::Unavailable`]: the server
/// was set up without them, and every request is answered 500 (logged as
/// an error), not taken for a client that did not say who it is.
///
/// Forwarding headers are read only when the peer is a proxy you trust
/// ([`trust_proxies`](ClientIp::trust_proxies)); `ClientIp::new()` trusts
/// nobody, so a client cannot pick its own counter by sending
/// `X-Forwarded-For`. Behind a trusted proxy the header's entries are read
/// from the right, skipping those that are trusted proxies too: the first
/// untrusted address is the client, and when every entry is a trusted proxy
/// the leftmost one is. Entries left of the client were written by the client
/// and are never read.
///
/// Only one header is read: `X-Forwarded-For` by default, or RFC 7239
/// `Forwarded` ([`ProxyHeader::Forwarded`]). Pick the one your proxy writes: a
/// proxy that appends to one passes the other through from the client as it
/// came. A trusted peer that sends no such header (a health check from the
/// proxy itself) is charged as the client.
///
/// An entry that has to be read and is not an address (garbage, `unknown`,
/// an obfuscated `for=_hidden`, a `Forwarded` element without `for=`, or
/// with a parameter whose name is no token or whose quoted value is not
/// closed, which would swallow what the proxy appended after it) makes
/// the subject [`SubjectError::Malformed`] (400 by default): the request is
/// never charged to the proxy's own address, which every client behind it
/// would share. Entries may carry a port (`203.0.113.7:4711`,
/// `[2001:db8::1]:4711`); empty list elements are skipped. At most
/// 64 entries are read from the right, and the headers are scanned once:
/// more than 64 trusted hops in a row is malformed.
///
/// # Ids
///
/// An IPv4 client is its address (`203.0.113.7`). An IPv6 client is its /64
/// network (`2001:db8:1:2::/64`): one host usually holds a whole /64, so
/// counting addresses would let it pick a fresh counter per request. Change
/// the grouping with [`ipv6_prefix`](ClientIp::ipv6_prefix) and
/// [`ipv4_prefix`](ClientIp::ipv4_prefix). An IPv4-mapped IPv6 address
/// (`::ffff:203.0.113.7`, as a dual-stack socket reports IPv4 peers) is the
/// IPv4 address, for the trust check as for the id; so is an address of
/// the NAT64 well-known prefix (`64:ff9b::203.0.113.7`, an IPv4 client as
/// a translator presents it), which would otherwise put every IPv4 client
/// in one /64.
///
/// Behind a proxy that is *not* trusted, every client is charged as the
/// proxy: one counter for everyone.
///
/// # Example
///
/// Serve with the peer address, behind a load balancer in `10.0.0.0/8`:
///
/// ```no_run
/// use std::net::SocketAddr;
///
/// use axum::{routing::get, Router};
/// use tower_quota::{ClientIp, QuotaLayer};
///
/// # async fn serve() {
/// let clients = ClientIp::new().trust_proxies(["10.0.0.0/8".parse().unwrap()]);
/// let app = Router::new()
///     .route("/", get(|| async { "hello" }))
///     .layer(QuotaLayer::daily(100, clients));
///
/// let listener = tokio::net::TcpListener::bind("0.0.0.0:3000").await.unwrap();
/// axum::serve(listener, app.into_make_service_with_connect_info::<SocketAddr>())
///     .await
///     .unwrap();
/// # }
/// ```
///
/// What the layer then sees, with the peer address put in by hand:
///
/// ```
/// use std::net::SocketAddr;
///
/// use axum::{body::Body, extract::ConnectInfo, routing::get, Router};
/// use http::{Request, StatusCode};
/// use tower::ServiceExt;
/// use tower_quota::{ClientIp, QuotaLayer};
///
/// # #[tokio::main(flavor = "current_thread")] async fn main() {
/// let clients = ClientIp::new().trust_proxy_cidrs(&["10.0.0.0/8"]);
/// let app = Router::new()
///     .route("/", get(|| async { "hello" }))
///     .layer(QuotaLayer::daily(1, clients));
///
/// let call = |peer: &str, forwarded_for: &str| {
///     let mut request = Request::get("/").header("x-forwarded-for", forwarded_for);
///     let peer: SocketAddr = peer.parse().unwrap();
///     request = request.extension(ConnectInfo(peer));
///     app.clone().oneshot(request.body(Body::empty()).unwrap())
/// };
///
/// // Through the load balancer: the client it names pays.
/// let first = call("10.0.0.2:41000", "203.0.113.7").await.unwrap();
/// assert_eq!(first.status(), StatusCode::OK);
/// let again = call("10.0.0.3:41000", "198.51.100.1, 203.0.113.7").await.unwrap();
/// assert_eq!(again.status(), StatusCode::TOO_MANY_REQUESTS);
///
/// // Straight from the internet, the header is ignored: the peer pays.
/// let direct = call("192.0.2.9:5000", "198.51.100.1").await.unwrap();
/// assert_eq!(direct.status(), StatusCode::OK);
/// let spoofed = call("192.0.2.9:5000", "198.51.100.2").await.unwrap();
/// assert_eq!(spoofed.status(), StatusCode::TOO_MANY_REQUESTS);
///
/// // A broken header from the load balancer is a 400, not the balancer's counter.
/// let broken = call("10.0.0.2:41000", "not-an-ip").await.unwrap();
/// assert_eq!(broken.status(), StatusCode::BAD_REQUEST);
/// # }
/// ```
#[derive(Clone, Debug)]
pub struct ClientIp {
    trusted: Vec<IpNet>,
    header: ProxyHeader,
    ipv4_prefix: u8,
    ipv6_prefix: u8,
}

/// The forwarding header [`ClientIp`] reads behind a trusted proxy.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum ProxyHeader {
    /// `X-Forwarded-For: 203.0.113.7, 10.0.0.2`: what nginx, HAProxy and the
    /// cloud load balancers append to.
    #[default]
    XForwardedFor,
    /// RFC 7239 `Forwarded: for=203.0.113.7, for="[2001:db8::1]:4711"`.
    Forwarded,
}

impl ProxyHeader {
    fn name(self) -> &'static HeaderName {
        match self {
            Self::XForwardedFor => &X_FORWARDED_FOR,
            Self::Forwarded => &FORWARDED,
        }
    }
}

impl Default for ClientIp {
    fn default() -> Self {
        Self::new()
    }
}

impl ClientIp {
    /// Charges the peer address of the connection, trusting no proxy; IPv6
    /// grouped by /64.
    #[must_use]
    pub fn new() -> Self {
        Self {
            trusted: Vec::new(),
            header: ProxyHeader::XForwardedFor,
            ipv4_prefix: 32,
            ipv6_prefix: 64,
        }
    }

    /// Trusts the proxies in these networks to tell the client's address in
    /// the forwarding header (added to those already trusted).
    ///
    /// Name only proxies you run or pay for, and every hop of the chain: a
    /// trusted network that holds clients lets them pose as anyone.
    ///
    /// ```
    /// use tower_quota::{ipnet::IpNet, ClientIp};
    ///
    /// let nets: Vec<IpNet> = vec!["10.0.0.0/8".parse().unwrap(), "fd00::/8".parse().unwrap()];
    /// let clients = ClientIp::new().trust_proxies(nets);
    /// ```
    #[must_use]
    pub fn trust_proxies(mut self, networks: impl IntoIterator<Item = IpNet>) -> Self {
        self.trusted
            .extend(networks.into_iter().map(|net| canonical_net(net.trunc())));
        self
    }

    /// Trusts the proxies in these networks, written as text: CIDR
    /// networks (`10.0.0.0/8`, `fd00::/8`) or single addresses (`192.0.2.1`).
    /// See [`trust_proxies`](ClientIp::trust_proxies).
    ///
    /// # Panics
    ///
    /// When an entry is neither a network nor an address: a configuration
    /// mistake to find at startup, not per request.
    #[must_use]
    pub fn trust_proxy_cidrs<S: AsRef<str>>(self, networks: impl IntoIterator<Item = S>) -> Self {
        let networks: Vec<IpNet> = networks
            .into_iter()
            .map(|text| {
                let text = text.as_ref();
                text.parse::<IpNet>()
                    .or_else(|_| text.parse::<IpAddr>().map(IpNet::from))
                    .unwrap_or_else(|_| {
                        panic!("{text:?} is not a CIDR network (10.0.0.0/8) nor an IP address")
                    })
            })
            .collect();
        self.trust_proxies(networks)
    }

    /// Which forwarding header to read behind a trusted proxy:
    /// `X-Forwarded-For` by default. The other one is ignored.
    #[must_use]
    pub fn proxy_header(mut self, header: ProxyHeader) -> Self {
        self.header = header;
        self
    }

    /// Groups IPv6 clients by networks of this prefix length: 64 by default,
    /// 128 to count single addresses, 48 or 56 for whole sites.
    ///
    /// # Panics
    ///
    /// When `bits` is not in `1..=128`.
    #[must_use]
    pub fn ipv6_prefix(mut self, bits: u8) -> Self {
        assert!(
            (1..=128).contains(&bits),
            "an IPv6 prefix is 1 to 128 bits (got {bits})"
        );
        self.ipv6_prefix = bits;
        self
    }

    /// Groups IPv4 clients by networks of this prefix length: 32 (single
    /// addresses) by default, 24 to count whole /24 networks.
    ///
    /// # Panics
    ///
    /// When `bits` is not in `1..=32`.
    #[must_use]
    pub fn ipv4_prefix(mut self, bits: u8) -> Self {
        assert!(
            (1..=32).contains(&bits),
            "an IPv4 prefix is 1 to 32 bits (got {bits})"
        );
        self.ipv4_prefix = bits;
        self
    }

    /// The client's address, before grouping into networks; IPv4-mapped
    /// IPv6 addresses as IPv4.
    pub fn client_ip(&self, parts: &Parts) -> Result<IpAddr, SubjectError> {
        let peer = peer_ip(parts).ok_or_else(no_peer)?;
        self.client_behind(parts, canonical(peer))
    }

    fn is_trusted(&self, ip: IpAddr) -> bool {
        self.trusted.iter().any(|net| net.contains(&ip))
    }

    fn client_behind<'p>(&self, parts: &'p Parts, peer: IpAddr) -> Result<IpAddr, SubjectError> {
        if !self.is_trusted(peer) {
            return Ok(peer);
        }
        let name = self.header.name();
        // The rightmost MAX_HOPS + 1 entries: one more than is read tells a
        // chain that is too long from one that is just long enough.
        let mut hops: VecDeque<&[u8]> = VecDeque::new();
        let mut keep = |entry: &'p [u8]| {
            let entry = entry.trim_ascii();
            if entry.is_empty() {
                return;
            }
            if hops.len() > MAX_HOPS {
                hops.pop_front();
            }
            hops.push_back(entry);
        };
        for value in parts.headers.get_all(name) {
            match self.header {
                ProxyHeader::XForwardedFor => {
                    value.as_bytes().split(|&b| b == b',').for_each(&mut keep)
                }
                ProxyHeader::Forwarded => {
                    split_unquoted(value.as_bytes(), b',').for_each(&mut keep)
                }
            }
        }
        let mut leftmost = None;
        for entry in hops.iter().rev().take(MAX_HOPS) {
            let hop = match self.header {
                ProxyHeader::XForwardedFor => x_forwarded_for_entry(entry),
                ProxyHeader::Forwarded => forwarded_element(entry),
            }
            .map(canonical)
            .map_err(|reason| SubjectError::Malformed(format!("{name}: {reason}").into()))?;
            if !self.is_trusted(hop) {
                return Ok(hop);
            }
            leftmost = Some(hop);
        }
        if hops.len() > MAX_HOPS {
            return Err(SubjectError::Malformed(
                format!("{name}: more than {MAX_HOPS} trusted proxies in a row").into(),
            ));
        }
        Ok(leftmost.unwrap_or(peer))
    }

    fn id(&self, ip: IpAddr) -> String {
        match ip {
            IpAddr::V4(ip) if self.ipv4_prefix == 32 => ip.to_string(),
            IpAddr::V4(ip) => Ipv4Net::new(ip, self.ipv4_prefix)
                .expect("checked by ipv4_prefix")
                .trunc()
                .to_string(),
            IpAddr::V6(ip) if self.ipv6_prefix == 128 => ip.to_string(),
            IpAddr::V6(ip) => Ipv6Net::new(ip, self.ipv6_prefix)
                .expect("checked by ipv6_prefix")
                .trunc()
                .to_string(),
        }
    }
}

impl SubjectExtractor for ClientIp {
    fn extract(&self, parts: &Parts) -> Result<Subject, SubjectError> {
        let client = self.client_ip(parts)?;
        Ok(Subject::new(SubjectKind::IP, self.id(client)))
    }

    fn kinds(&self) -> Option<Vec<SubjectKind>> {
        Some(vec![SubjectKind::IP])
    }

    /// The counter a client at the address `id`, or any client in the
    /// network `id` (at least as narrow as the grouping), is charged to:
    /// `2001:db8:1:2::9` and `2001:DB8:1:2::/64` are both
    /// `2001:db8:1:2::/64` under the default grouping, `::ffff:203.0.113.7`
    /// is `203.0.113.7`. Anything else is refused.
    fn subject_named(&self, kind: &SubjectKind, id: &[u8]) -> Result<Subject, SubjectError> {
        let text = std::str::from_utf8(id).unwrap_or_default();
        let ip = if let Ok(ip) = text.parse::<IpAddr>() {
            canonical(ip)
        } else if let Ok(net) = text.parse::<IpNet>() {
            let net = canonical_net(net);
            let grouped = match net {
                IpNet::V4(_) => self.ipv4_prefix,
                IpNet::V6(_) => self.ipv6_prefix,
            };
            if net.prefix_len() < grouped {
                return Err(SubjectError::Malformed(
                    format!(
                        "{net} spans many counters: clients are counted per /{grouped} network"
                    )
                    .into(),
                ));
            }
            // Narrower than the grouping yet wider than a /96 that holds
            // IPv4 clients (IPv4-mapped, NAT64), each charged as its IPv4
            // address: its clients are on those counters and on its IPv6
            // ones', not on one (a network written as the grouping is a
            // counter's own id, and names it).
            if let IpNet::V6(v6) = net {
                if v6.prefix_len() > self.ipv6_prefix
                    && v6.prefix_len() < 96
                    && FOLDED.iter().any(|folded| v6.contains(folded))
                {
                    return Err(SubjectError::Malformed(
                        format!(
                            "{net} spans many counters: its IPv4-mapped and NAT64 clients are \
                             counted per IPv4 address"
                        )
                        .into(),
                    ));
                }
            }
            // Folded already where it names IPv4 clients; a wider IPv6
            // network is its own counter's, whatever its first address.
            net.network()
        } else {
            return Err(SubjectError::Malformed(
                "a client's id is an IP address or network".into(),
            ));
        };
        Ok(Subject::new(kind.clone(), self.id(ip)))
    }
}

/// A request without its peer's address: the server does not hand it over
/// (axum serves it with `into_make_service_with_connect_info`).
fn no_peer() -> SubjectError {
    SubjectError::Unavailable(
        "ClientIp found no peer address in the request: serve the app with \
         `into_make_service_with_connect_info::<SocketAddr>()`, or put the peer's `SocketAddr` \
         or `IpAddr` in the request's extensions"
            .into(),
    )
}

/// The peer address the server put in the request extensions.
fn peer_ip(parts: &Parts) -> Option<IpAddr> {
    #[cfg(feature = "axum")]
    if let Some(axum::extract::ConnectInfo(addr)) = parts
        .extensions
        .get::<axum::extract::ConnectInfo<SocketAddr>>()
    {
        return Some(addr.ip());
    }
    parts
        .extensions
        .get::<SocketAddr>()
        .map(SocketAddr::ip)
        .or_else(|| parts.extensions.get::<IpAddr>().copied())
}

/// The first addresses of the IPv6 /96 networks whose addresses are IPv4
/// clients (see [`canonical`]): IPv4-mapped and NAT64.
const FOLDED: [Ipv6Addr; 2] = [
    Ipv6Addr::new(0, 0, 0, 0, 0, 0xffff, 0, 0),
    Ipv6Addr::new(0x64, 0xff9b, 0, 0, 0, 0, 0, 0),
];

/// IPv4-mapped IPv6 addresses, and those of the NAT64 well-known prefix
/// `64:ff9b::/96` (RFC 6052), as the IPv4 address they carry.
fn canonical(ip: IpAddr) -> IpAddr {
    match ip {
        IpAddr::V6(v6) => {
            if let Some(v4) = v6.to_ipv4_mapped() {
                return IpAddr::V4(v4);
            }
            let [a, b, c, d, e, f, _, _] = v6.segments();
            if [a, b, c, d, e, f] == [0x64, 0xff9b, 0, 0, 0, 0] {
                let [.., w, x, y, z] = v6.octets();
                return IpAddr::V4(Ipv4Addr::new(w, x, y, z));
            }
            ip
        }
        IpAddr::V4(_) => ip,
    }
}

/// Networks of IPv4-mapped or NAT64 (`64:ff9b::/96`) IPv6 addresses as the
/// IPv4 network, so that they match the canonical addresses.
fn canonical_net(net: IpNet) -> IpNet {
    match net {
        IpNet::V6(v6) if v6.prefix_len() >= 96 => match canonical(IpAddr::V6(v6.network())) {
            IpAddr::V4(v4) => IpNet::V4(
                Ipv4Net::new(v4, v6.prefix_len() - 96).expect("a prefix of at most 32 bits"),
            ),
            IpAddr::V6(_) => net,
        },
        _ => net,
    }
}

const NOT_AN_ADDRESS: &str = "an entry is not an IP address";
const HIDDEN: &str = "an entry hides the client's address (unknown or an obfuscated _identifier)";

/// `203.0.113.7`, `2001:db8::1`, and either with a port.
fn x_forwarded_for_entry(entry: &[u8]) -> Result<IpAddr, &'static str> {
    node(std::str::from_utf8(entry).map_err(|_| NOT_AN_ADDRESS)?)
}

/// The `for=` node of one RFC 7239 forwarded-element, such as
/// `for="[2001:db8::1]:4711";proto=https`.
fn forwarded_element(element: &[u8]) -> Result<IpAddr, &'static str> {
    let mut found = None;
    for pair in split_unquoted(element, b';').map(<[u8]>::trim_ascii) {
        if pair.is_empty() {
            continue;
        }
        let eq = pair
            .iter()
            .position(|&b| b == b'=')
            .ok_or("a parameter is not name=value")?;
        // Every name a token and every value whole: a quote opened in
        // either (a client's own `x="` or `"x`) must not swallow what a
        // proxy appended after it.
        let name = pair[..eq].trim_ascii();
        if !is_token(name) {
            return Err("a parameter's name is not a token");
        }
        if !whole_value(pair[eq + 1..].trim_ascii()) {
            return Err("a parameter's value is an unclosed or cut quoted-string");
        }
        if name.eq_ignore_ascii_case(b"for") {
            if found.is_some() {
                return Err("an element has for= twice");
            }
            found = Some(pair[eq + 1..].trim_ascii());
        }
    }
    let value = unquote(found.ok_or("an element has no for=")?)?;
    node(&value)
}

/// Whether `name` is an RFC 9110 token: one character at least, each a
/// letter, a digit or one of ``!#$%&'*+-.^_`|~``.
fn is_token(name: &[u8]) -> bool {
    !name.is_empty()
        && name
            .iter()
            .all(|&b| b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b))
}

/// A token, or a quoted-string without its quotes and escapes.
fn unquote(value: &[u8]) -> Result<Cow<'_, str>, &'static str> {
    let Some(quoted) = value.strip_prefix(b"\"") else {
        return std::str::from_utf8(value)
            .map(Cow::Borrowed)
            .map_err(|_| NOT_AN_ADDRESS);
    };
    let inner = quoted
        .strip_suffix(b"\"")
        .ok_or("a quoted value is not closed")?;
    let text = std::str::from_utf8(inner).map_err(|_| NOT_AN_ADDRESS)?;
    if !text.contains('\\') {
        return Ok(Cow::Borrowed(text));
    }
    let mut unescaped = String::with_capacity(text.len());
    let mut chars = text.chars();
    while let Some(c) = chars.next() {
        unescaped.push(if c == '\\' {
            chars
                .next()
                .ok_or("a quoted value ends in a lone backslash")?
        } else {
            c
        });
    }
    Ok(Cow::Owned(unescaped))
}

/// An address, with an optional port: `203.0.113.7`, `203.0.113.7:4711`,
/// `2001:db8::1`, `[2001:db8::1]`, `[2001:db8::1]:4711` (ports may be
/// RFC 7239 obfuscated ports, `_x1`).
fn node(text: &str) -> Result<IpAddr, &'static str> {
    if text.eq_ignore_ascii_case("unknown") || text.starts_with('_') {
        return Err(HIDDEN);
    }
    if let Ok(ip) = text.parse::<IpAddr>() {
        return Ok(ip);
    }
    let (ip, port) = match text.strip_prefix('[') {
        Some(bracketed) => {
            let (host, after) = bracketed.split_once(']').ok_or(NOT_AN_ADDRESS)?;
            let ip = host.parse::<Ipv6Addr>().map_err(|_| NOT_AN_ADDRESS)?;
            let port = match after {
                "" => None,
                _ => Some(after.strip_prefix(':').ok_or(NOT_AN_ADDRESS)?),
            };
            (IpAddr::V6(ip), port)
        }
        None => {
            let (host, port) = text.split_once(':').ok_or(NOT_AN_ADDRESS)?;
            let ip = host.parse::<Ipv4Addr>().map_err(|_| NOT_AN_ADDRESS)?;
            (IpAddr::V4(ip), Some(port))
        }
    };
    match port {
        Some(port) if !is_port(port) => Err(NOT_AN_ADDRESS),
        _ => Ok(ip),
    }
}

/// `4711`, or an RFC 7239 obfuscated port such as `_abc`.
fn is_port(port: &str) -> bool {
    match port.strip_prefix('_') {
        Some(obfuscated) => {
            !obfuscated.is_empty()
                && obfuscated
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b"._-".contains(&b))
        }
        None => (1..=5).contains(&port.len()) && port.bytes().all(|b| b.is_ascii_digit()),
    }
}

/// Whether `value` is one quoted-string, closed at its end, or holds no
/// quote at all.
fn whole_value(value: &[u8]) -> bool {
    let Some(quoted) = value.strip_prefix(b"\"") else {
        return !value.contains(&b'"');
    };
    let mut escaped = false;
    for (i, &b) in quoted.iter().enumerate() {
        if escaped {
            escaped = false;
        } else if b == b'\\' {
            escaped = true;
        } else if b == b'"' {
            return i + 1 == quoted.len();
        }
    }
    false
}

/// Splits at `separator` outside quoted-strings (RFC 9110), in one pass. An
/// unclosed quote runs to the end: what follows is one piece, which then
/// fails to parse.
fn split_unquoted(bytes: &[u8], separator: u8) -> impl Iterator<Item = &[u8]> {
    let mut rest = Some(bytes);
    std::iter::from_fn(move || {
        let text = rest?;
        let (mut quoted, mut escaped) = (false, false);
        for (i, &b) in text.iter().enumerate() {
            if escaped {
                escaped = false;
            } else if quoted && b == b'\\' {
                escaped = true;
            } else if b == b'"' {
                quoted = !quoted;
            } else if b == separator && !quoted {
                rest = Some(&text[i + 1..]);
                return Some(&text[..i]);
            }
        }
        rest = None;
        Some(text)
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::{HeaderValue, Request};
    use proptest::prelude::*;

    fn ip(text: &str) -> IpAddr {
        text.parse().unwrap()
    }

    /// A request from `peer` (a `SocketAddr` extension) with these headers.
    fn from(peer: &str, headers: &[(&str, &str)]) -> Parts {
        let mut request = Request::get("/");
        for (name, value) in headers {
            request = request.header(*name, *value);
        }
        let mut parts = request.body(()).unwrap().into_parts().0;
        parts.extensions.insert(SocketAddr::new(ip(peer), 4711));
        parts
    }

    fn behind_proxies() -> ClientIp {
        ClientIp::new().trust_proxy_cidrs(["10.0.0.0/8", "fd00::/8", "192.0.2.1"])
    }

    fn id(ex: &ClientIp, parts: &Parts) -> Result<String, SubjectError> {
        let subject = ex.extract(parts)?;
        assert_eq!(subject.kind(), &SubjectKind::IP);
        Ok(String::from_utf8(subject.id().to_vec()).unwrap())
    }

    fn malformed(result: Result<String, SubjectError>) -> String {
        match result {
            Err(SubjectError::Malformed(reason)) => reason.into_owned(),
            other => panic!("expected malformed, got {other:?}"),
        }
    }

    #[test]
    fn ip_kind_is_a_named_kind() {
        assert_eq!(SubjectKind::custom("ip"), SubjectKind::IP);
        assert_eq!(SubjectKind::IP.as_str(), "ip");
    }

    #[test]
    fn peer_address_without_proxies() {
        let ex = ClientIp::new();
        assert_eq!(id(&ex, &from("203.0.113.7", &[])).unwrap(), "203.0.113.7");
    }

    #[test]
    fn no_peer_is_the_servers_mistake() {
        let parts = Request::get("/").body(()).unwrap().into_parts().0;
        assert_eq!(ClientIp::new().extract(&parts), Err(no_peer()));
        // Headers alone say nothing: they could come from anyone.
        let parts = Request::get("/")
            .header("x-forwarded-for", "203.0.113.7")
            .body(())
            .unwrap()
            .into_parts()
            .0;
        assert_eq!(behind_proxies().extract(&parts), Err(no_peer()));
    }

    #[test]
    fn ip_addr_extension() {
        let mut parts = Request::get("/").body(()).unwrap().into_parts().0;
        parts.extensions.insert(ip("198.51.100.4"));
        assert_eq!(id(&ClientIp::new(), &parts).unwrap(), "198.51.100.4");
    }

    #[cfg(feature = "axum")]
    #[test]
    fn connect_info_comes_first() {
        let mut parts = from("10.0.0.1", &[]);
        let addr: SocketAddr = "203.0.113.9:1000".parse().unwrap();
        parts.extensions.insert(axum::extract::ConnectInfo(addr));
        assert_eq!(id(&ClientIp::new(), &parts).unwrap(), "203.0.113.9");
    }

    #[test]
    fn spoofed_header_from_untrusted_peer_is_ignored() {
        let ex = behind_proxies();
        for (name, value) in [
            ("x-forwarded-for", "1.2.3.4"),
            ("forwarded", "for=1.2.3.4"),
            ("x-forwarded-for", "garbage"),
        ] {
            let parts = from("203.0.113.7", &[(name, value)]);
            assert_eq!(id(&ex, &parts).unwrap(), "203.0.113.7");
        }
        let parts = from("203.0.113.7", &[("forwarded", "for=1.2.3.4")]);
        let forwarded = behind_proxies().proxy_header(ProxyHeader::Forwarded);
        assert_eq!(id(&forwarded, &parts).unwrap(), "203.0.113.7");
    }

    #[test]
    fn trusted_peer_names_the_client() {
        let ex = behind_proxies();
        let parts = from("10.1.2.3", &[("x-forwarded-for", "203.0.113.7")]);
        assert_eq!(id(&ex, &parts).unwrap(), "203.0.113.7");
    }

    #[test]
    fn trusted_peer_without_header_is_the_client() {
        let ex = behind_proxies();
        assert_eq!(id(&ex, &from("10.1.2.3", &[])).unwrap(), "10.1.2.3");
        // Empty list elements are no entries at all.
        let parts = from("10.1.2.3", &[("x-forwarded-for", " , ")]);
        assert_eq!(id(&ex, &parts).unwrap(), "10.1.2.3");
    }

    #[test]
    fn multi_hop_chain_is_walked_from_the_right() {
        let ex = behind_proxies();
        // client, spoofed by the client, then two of our proxies.
        let parts = from(
            "10.0.0.1",
            &[(
                "x-forwarded-for",
                "6.6.6.6, 203.0.113.7, 10.0.0.9, 192.0.2.1",
            )],
        );
        assert_eq!(id(&ex, &parts).unwrap(), "203.0.113.7");
    }

    #[test]
    fn entries_left_of_the_client_are_never_read() {
        let ex = behind_proxies();
        let parts = from(
            "10.0.0.1",
            &[("x-forwarded-for", "garbage, _x, 203.0.113.7")],
        );
        assert_eq!(id(&ex, &parts).unwrap(), "203.0.113.7");
    }

    #[test]
    fn all_trusted_means_the_leftmost() {
        let ex = behind_proxies();
        let parts = from("10.0.0.1", &[("x-forwarded-for", "10.0.0.7, 10.0.0.8")]);
        assert_eq!(id(&ex, &parts).unwrap(), "10.0.0.7");
    }

    #[test]
    fn repeated_headers_are_one_list_in_order() {
        let ex = behind_proxies();
        let parts = from(
            "10.0.0.1",
            &[
                ("x-forwarded-for", "6.6.6.6"),
                ("x-forwarded-for", "203.0.113.7, 10.0.0.3"),
                ("x-forwarded-for", "10.0.0.4"),
            ],
        );
        assert_eq!(id(&ex, &parts).unwrap(), "203.0.113.7");
        let parts = from(
            "10.0.0.1",
            &[
                ("x-forwarded-for", "203.0.113.7"),
                ("x-forwarded-for", "10.0.0.3"),
            ],
        );
        assert_eq!(id(&ex, &parts).unwrap(), "203.0.113.7");
    }

    #[test]
    fn ports_and_brackets_in_x_forwarded_for() {
        let ex = behind_proxies().ipv6_prefix(128);
        for (entry, want) in [
            ("203.0.113.7:4711", "203.0.113.7"),
            ("[2001:db8::1]:4711", "2001:db8::1"),
            ("[2001:db8::1]", "2001:db8::1"),
            ("2001:db8::1", "2001:db8::1"),
        ] {
            let parts = from("10.0.0.1", &[("x-forwarded-for", entry)]);
            assert_eq!(id(&ex, &parts).unwrap(), want, "{entry}");
        }
    }

    #[test]
    fn malformed_entries_are_400_not_the_proxy() {
        let ex = behind_proxies();
        for entry in [
            "garbage",
            "unknown",
            "203.0.113.7, nope",
            "203.0.113.7:",
            "203.0.113.7:123456",
            "203.0.113.7:http",
            // An obfuscated port is `_` and one character at least.
            "203.0.113.7:_",
            "[2001:db8::1",
            "[2001:db8::1]4711",
            "[203.0.113.7]",
            "2001:db8::1:4711:x",
            "300.1.1.1",
            "\"203.0.113.7\"",
        ] {
            let parts = from("10.0.0.1", &[("x-forwarded-for", entry)]);
            let reason = malformed(id(&ex, &parts));
            assert!(reason.starts_with("x-forwarded-for: "), "{reason}");
        }
        // Not UTF-8.
        let mut parts = from("10.0.0.1", &[]);
        parts.headers.insert(
            "x-forwarded-for",
            HeaderValue::from_bytes(b"203.0.113.\xff").unwrap(),
        );
        malformed(id(&ex, &parts));
    }

    #[test]
    fn forwarded_header() {
        let ex = behind_proxies().proxy_header(ProxyHeader::Forwarded);
        for (value, want) in [
            ("for=203.0.113.7", "203.0.113.7"),
            ("For=\"203.0.113.7:4711\"", "203.0.113.7"),
            ("for=\"[2001:db8:1:2::9]:4711\"", "2001:db8:1:2::/64"),
            ("for=\"[2001:db8:1:2::9]\"", "2001:db8:1:2::/64"),
            ("for=\"[2001:db8:1:2::9]:_port-1\"", "2001:db8:1:2::/64"),
            ("for=\"\\[2001:db8:1:2::9\\]\"", "2001:db8:1:2::/64"),
            ("for=203.0.113.7;proto=https;by=10.0.0.1", "203.0.113.7"),
            ("proto=https; for=203.0.113.7", "203.0.113.7"),
            ("for=6.6.6.6, for=203.0.113.7, for=10.0.0.5", "203.0.113.7"),
            // Quoted commas and semicolons are not separators.
            (
                "for=203.0.113.7;host=\"a,b;c\", for=10.0.0.5",
                "203.0.113.7",
            ),
            // Left of the client, anything goes.
            ("for=_hidden, for=203.0.113.7", "203.0.113.7"),
            // Outside a quoted-string a backslash escapes nothing: the
            // client's does not swallow the element appended after it.
            ("for=6.6.6.6\\, for=203.0.113.7", "203.0.113.7"),
        ] {
            let parts = from("10.0.0.1", &[("forwarded", value)]);
            assert_eq!(id(&ex, &parts).unwrap(), want, "{value}");
        }
        // X-Forwarded-For is not read when Forwarded is chosen, and the
        // reverse.
        let parts = from(
            "10.0.0.1",
            &[
                ("forwarded", "for=203.0.113.7"),
                ("x-forwarded-for", "198.51.100.1"),
            ],
        );
        assert_eq!(id(&ex, &parts).unwrap(), "203.0.113.7");
        assert_eq!(id(&behind_proxies(), &parts).unwrap(), "198.51.100.1");
        let only_xff = from("10.0.0.1", &[("x-forwarded-for", "198.51.100.1")]);
        assert_eq!(id(&ex, &only_xff).unwrap(), "10.0.0.1");
    }

    #[test]
    fn forwarded_malformed() {
        let ex = behind_proxies().proxy_header(ProxyHeader::Forwarded);
        for value in [
            "for=_hidden",
            "for=unknown",
            "for=\"_x\"",
            "proto=https",
            "for=203.0.113.7;for=203.0.113.8",
            "for",
            "for=\"203.0.113.7",
            "for=\"203.0.113.7\\\"",
            "for=\"[2001:db8::1]:port\"",
            "for=2001:db8::1:x",
            "for=203.0.113.7, for=unknown",
            // A quote the client left open swallows the proxy's element
            // appended on the same line.
            "for=198.51.100.1;x=\", for=203.0.113.9",
            "for=198.51.100.1;x=\", for=\"[2001:db8::5]\"",
            "for=198.51.100.1;x=a\"b",
            // A quote in a parameter's name swallows it the same way.
            "for=6.6.6.6;\"x, for=203.0.113.9",
            "for=6.6.6.6;\"x=, for=203.0.113.9",
            "for=6.6.6.6;\"x, for=\"[2001:db8::5]\"",
            "for=6.6.6.6;x\"y=1, for=203.0.113.9",
            // A name that is no token, or none.
            "for=203.0.113.7;=1",
            "for=203.0.113.7;a b=1",
            "f\u{f6}r=203.0.113.7",
        ] {
            let parts = from("10.0.0.1", &[("forwarded", value)]);
            let reason = malformed(id(&ex, &parts));
            assert!(reason.starts_with("forwarded: "), "{value}: {reason}");
        }
        let hidden = from("10.0.0.1", &[("forwarded", "for=_hidden")]);
        assert!(malformed(id(&ex, &hidden)).contains("hides"));
    }

    /// What the trusted proxy at 10.0.0.1 forwards for the client
    /// 203.0.113.9 when it appends its element to the line the client sent
    /// (nginx: `"$http_forwarded, for=$remote_addr"`): whatever the client
    /// wrote, it is charged as itself or refused, never as another.
    #[test]
    fn forwarded_appended_to_a_clients_line_names_the_client() {
        let ex = behind_proxies().proxy_header(ProxyHeader::Forwarded);
        for client_sent in [
            "",
            "for=6.6.6.6, ",
            "for=6.6.6.6;\"x, ",
            "for=6.6.6.6;\"x=, ",
            "for=6.6.6.6;x=\", ",
            "for=6.6.6.6;x=a\"b, ",
            "for=\"6.6.6.6, ",
            "for=6.6.6.6;x\"=1, ",
            "\"for=6.6.6.6, ",
        ] {
            let value = format!("{client_sent}for=203.0.113.9");
            let got = id(&ex, &from("10.0.0.1", &[("forwarded", &value)]));
            assert!(
                matches!(&got, Err(SubjectError::Malformed(_)))
                    || got.as_deref() == Ok("203.0.113.9"),
                "{value}: {got:?}"
            );
        }
    }

    #[test]
    fn ipv6_clients_share_their_64() {
        let ex = ClientIp::new();
        let a = id(&ex, &from("2001:db8:1:2::1", &[])).unwrap();
        let b = id(&ex, &from("2001:db8:1:2:ffff:ffff:ffff:ffff", &[])).unwrap();
        let c = id(&ex, &from("2001:db8:1:3::1", &[])).unwrap();
        assert_eq!(a, "2001:db8:1:2::/64");
        assert_eq!(a, b);
        assert_ne!(a, c);
    }

    #[test]
    fn configurable_prefixes() {
        let ex = ClientIp::new().ipv6_prefix(48).ipv4_prefix(24);
        assert_eq!(
            id(&ex, &from("2001:db8:1:2::1", &[])).unwrap(),
            "2001:db8:1::/48"
        );
        assert_eq!(
            id(&ex, &from("203.0.113.7", &[])).unwrap(),
            "203.0.113.0/24"
        );
        let exact = ClientIp::new().ipv6_prefix(128);
        assert_eq!(
            id(&exact, &from("2001:db8:1:2::1", &[])).unwrap(),
            "2001:db8:1:2::1"
        );
    }

    /// Every grouping groups, to the last bit: under a /31 (a /127) two
    /// neighbours share one counter, named as the network; only /32
    /// (/128) counts single addresses.
    #[test]
    fn every_prefix_length_groups_neighbours() {
        for bits in 1..=32 {
            let ex = ClientIp::new().ipv4_prefix(bits);
            let a = id(&ex, &from("203.0.113.6", &[])).unwrap();
            let b = id(&ex, &from("203.0.113.7", &[])).unwrap();
            if bits == 32 {
                assert_ne!(a, b);
            } else {
                assert_eq!(a, b, "/{bits}");
                assert!(a.ends_with(&format!("/{bits}")), "/{bits}: {a}");
            }
        }
        for bits in 1..=128 {
            let ex = ClientIp::new().ipv6_prefix(bits);
            let a = id(&ex, &from("2001:db8::6", &[])).unwrap();
            let b = id(&ex, &from("2001:db8::7", &[])).unwrap();
            if bits == 128 {
                assert_ne!(a, b);
            } else {
                assert_eq!(a, b, "/{bits}");
                assert!(a.ends_with(&format!("/{bits}")), "/{bits}: {a}");
            }
        }
    }

    #[test]
    #[should_panic(expected = "an IPv6 prefix is 1 to 128 bits")]
    fn ipv6_prefix_zero_panics() {
        let _ = ClientIp::new().ipv6_prefix(0);
    }

    #[test]
    #[should_panic(expected = "an IPv6 prefix is 1 to 128 bits")]
    fn ipv6_prefix_too_long_panics() {
        let _ = ClientIp::new().ipv6_prefix(129);
    }

    #[test]
    #[should_panic(expected = "an IPv4 prefix is 1 to 32 bits")]
    fn ipv4_prefix_too_long_panics() {
        let _ = ClientIp::new().ipv4_prefix(33);
    }

    #[test]
    #[should_panic(expected = "\"10.0.0.0/33\" is not a CIDR network")]
    fn invalid_cidr_panics() {
        let _ = ClientIp::new().trust_proxy_cidrs(["10.0.0.0/33"]);
    }

    #[test]
    fn mapped_addresses_are_ipv4() {
        let ex = behind_proxies();
        // The peer, as a dual-stack socket reports it: trusted as 10.0.0.1.
        let parts = from(
            "::ffff:10.0.0.1",
            &[("x-forwarded-for", "::ffff:203.0.113.7")],
        );
        assert_eq!(id(&ex, &parts).unwrap(), "203.0.113.7");
        assert_eq!(
            id(&ClientIp::new(), &from("::ffff:203.0.113.7", &[])).unwrap(),
            "203.0.113.7"
        );
        // Trusted networks written as mapped addresses match too.
        let mapped = ClientIp::new().trust_proxy_cidrs(["::ffff:10.0.0.0/104"]);
        let parts = from("10.0.0.1", &[("x-forwarded-for", "203.0.113.7")]);
        assert_eq!(id(&mapped, &parts).unwrap(), "203.0.113.7");
    }

    #[test]
    fn nat64_addresses_are_the_ipv4_clients_they_carry() {
        // Two IPv4 clients behind a translator: two subjects, not one /64.
        let ex = behind_proxies();
        for (forwarded, client) in [
            ("64:ff9b::203.0.113.7", "203.0.113.7"),
            ("64:ff9b::c633:6408", "198.51.100.8"),
        ] {
            let parts = from("10.0.0.1", &[("x-forwarded-for", forwarded)]);
            assert_eq!(id(&ex, &parts).unwrap(), client);
        }
        // Another prefix is IPv6, grouped by its /64.
        let parts = from("10.0.0.1", &[("x-forwarded-for", "64:ff9c::c633:6408")]);
        assert_eq!(id(&ex, &parts).unwrap(), "64:ff9c::/64");
    }

    /// A support call names a client as an address or a network, which is
    /// the counter `extract` charges it to, or a refusal.
    #[test]
    fn a_named_address_or_network_is_the_counter_its_clients_are_charged_to() {
        let named = |ex: &ClientIp, id: &str| {
            ex.subject_named(&SubjectKind::IP, id.as_bytes())
                .map(|s| String::from_utf8(s.id().to_vec()).unwrap())
        };
        let ex = ClientIp::new();
        for (id, counter) in [
            ("2001:db8:1:2::9", "2001:db8:1:2::/64"),
            ("2001:DB8:1:2::/64", "2001:db8:1:2::/64"),
            ("::ffff:203.0.113.7", "203.0.113.7"),
            ("64:ff9b::203.0.113.7", "203.0.113.7"),
            ("64:ff9b::cb00:7107/128", "203.0.113.7"),
            // NAT64's /64 holds IPv6 clients outside its /96 too: theirs.
            ("64:ff9b::/64", "64:ff9b::/64"),
        ] {
            assert_eq!(named(&ex, id).as_deref(), Ok(counter), "{id}");
        }
        for id in [
            "64:ff9b::cb00:7100/120",
            "2001:db8::/48",
            "203.0.113.0/24",
            "x",
            "",
        ] {
            assert!(named(&ex, id).is_err(), "{id}");
        }
        let by_24 = ClientIp::new().ipv4_prefix(24);
        assert_eq!(
            named(&by_24, "64:ff9b::cb00:7100/120").as_deref(),
            Ok("203.0.113.0/24")
        );
    }

    /// A trusted proxy range written in NAT64 form is the IPv4 range its
    /// hops are read as.
    #[test]
    fn a_trusted_nat64_range_is_its_ipv4_range() {
        let ex = ClientIp::new().trust_proxy_cidrs(["64:ff9b::a00:0/104"]);
        let parts = from(
            "10.0.0.1",
            &[("x-forwarded-for", "203.0.113.7, 64:ff9b::a00:2")],
        );
        assert_eq!(id(&ex, &parts).unwrap(), "203.0.113.7");
    }

    /// A trusted range that is a whole /96 of IPv4 clients (IPv4-mapped or
    /// NAT64) is all of IPv4, as its addresses are read: the proxies in it
    /// name their clients, each on a counter of its own, not the proxy's;
    /// and support cannot name it as one counter.
    #[test]
    fn a_trusted_96_of_ipv4_clients_is_all_of_ipv4() {
        for range in ["::ffff:0:0/96", "64:ff9b::/96"] {
            let ex = ClientIp::new().trust_proxy_cidrs([range]);
            for (peer, client) in [
                ("10.0.0.1", "203.0.113.7"),
                ("::ffff:10.0.0.1", "198.51.100.8"),
                ("64:ff9b::a00:1", "192.0.2.44"),
            ] {
                let parts = from(peer, &[("x-forwarded-for", client)]);
                assert_eq!(id(&ex, &parts).unwrap(), client, "{range}, {peer}");
            }
            assert!(
                ex.subject_named(&SubjectKind::IP, range.as_bytes())
                    .is_err(),
                "{range}"
            );
        }
    }

    #[test]
    fn hop_limit() {
        let ex = behind_proxies();
        let trusted = vec!["10.0.0.2"; MAX_HOPS].join(",");
        let at_limit = from("10.0.0.1", &[("x-forwarded-for", &trusted)]);
        assert_eq!(id(&ex, &at_limit).unwrap(), "10.0.0.2");
        let over = format!("203.0.113.7,{trusted}");
        let over = from("10.0.0.1", &[("x-forwarded-for", &over)]);
        assert!(malformed(id(&ex, &over)).contains("more than 64"));
        // A long spoofed prefix is harmless when the client is near the right.
        let long = format!("{},203.0.113.7,10.0.0.2", vec!["x"; 10_000].join(","));
        let long = from("10.0.0.1", &[("x-forwarded-for", &long)]);
        assert_eq!(id(&ex, &long).unwrap(), "203.0.113.7");
    }

    #[cfg(feature = "axum")]
    #[tokio::test]
    async fn router_with_connect_info() {
        use axum::{body::Body, extract::ConnectInfo, routing::get, Router};
        use http::StatusCode;
        use tower::ServiceExt;

        let app = Router::new()
            .route("/", get(|| async { "hi" }))
            .layer(crate::QuotaLayer::daily(1, behind_proxies()));
        let call = |peer: &str, xff: Option<&str>| {
            let mut request = Request::get("/");
            if let Some(xff) = xff {
                request = request.header("x-forwarded-for", xff);
            }
            let peer = SocketAddr::new(ip(peer), 5000);
            let request = request
                .extension(ConnectInfo(peer))
                .body(Body::empty())
                .unwrap();
            app.clone().oneshot(request)
        };
        let status = |response: Result<http::Response<_>, _>| response.unwrap().status();
        // Two clients in the same /64 behind the proxy share one counter.
        assert_eq!(
            status(call("10.0.0.1", Some("2001:db8::1")).await),
            StatusCode::OK
        );
        assert_eq!(
            status(call("10.0.0.1", Some("2001:db8::2")).await),
            StatusCode::TOO_MANY_REQUESTS
        );
        // Another /64 has its own.
        assert_eq!(
            status(call("10.0.0.1", Some("2001:db8:0:1::1")).await),
            StatusCode::OK
        );
        // The proxy's own address is a counter of its own, untouched so far.
        assert_eq!(status(call("10.0.0.1", None).await), StatusCode::OK);
        // No peer address at all: the server's setup, not the client, is
        // at fault.
        let anonymous = Request::get("/").body(Body::empty()).unwrap();
        assert_eq!(
            app.clone().oneshot(anonymous).await.unwrap().status(),
            StatusCode::INTERNAL_SERVER_ERROR
        );
    }

    /// Header values as a client could send them, weighted towards the
    /// characters the parsers care about.
    fn header_value() -> impl Strategy<Value = Vec<u8>> {
        let byte = prop_oneof![
            4 => prop::sample::select(b"0123456789abcdef.:[],;=\"\\_ fFoOrRxX".to_vec()),
            1 => 0x20u8..=0x7e,
            1 => 0x80u8..=0xff,
            1 => Just(b'\t'),
        ];
        prop::collection::vec(byte, 0..80)
    }

    fn address() -> impl Strategy<Value = IpAddr> {
        prop_oneof![
            any::<u32>().prop_map(|n| IpAddr::V4(Ipv4Addr::from(n))),
            any::<u128>().prop_map(|n| IpAddr::V6(Ipv6Addr::from(n))),
            any::<u32>().prop_map(|n| IpAddr::V6(Ipv4Addr::from(n).to_ipv6_mapped())),
            Just(ip("10.0.0.1")),
        ]
    }

    fn with_headers(peer: IpAddr, xff: &[Vec<u8>], forwarded: &[Vec<u8>]) -> Parts {
        let mut parts = Request::get("/").body(()).unwrap().into_parts().0;
        for value in xff {
            parts.headers.append(
                "x-forwarded-for",
                HeaderValue::from_bytes(value).expect("no control bytes"),
            );
        }
        for value in forwarded {
            parts.headers.append(
                FORWARDED,
                HeaderValue::from_bytes(value).expect("no control bytes"),
            );
        }
        parts.extensions.insert(peer);
        parts
    }

    proptest! {
        #[test]
        fn never_panics(
            peer in address(),
            xff in prop::collection::vec(header_value(), 0..4),
            forwarded in prop::collection::vec(header_value(), 0..4),
            trust_everyone in any::<bool>(),
        ) {
            let parts = with_headers(peer, &xff, &forwarded);
            let trusted = if trust_everyone {
                ClientIp::new().trust_proxy_cidrs(["0.0.0.0/0", "::/0"])
            } else {
                behind_proxies()
            };
            for ex in [trusted.clone(), trusted.proxy_header(ProxyHeader::Forwarded)] {
                match ex.extract(&parts) {
                    Ok(subject) => prop_assert!(!subject.id().is_empty()),
                    Err(SubjectError::Malformed(reason)) => prop_assert!(!reason.is_empty()),
                    Err(SubjectError::Missing | SubjectError::Unavailable(_)) => {
                        prop_assert!(false, "the peer is known")
                    }
                }
            }
        }

        #[test]
        fn untrusted_peer_is_the_client_whatever_the_headers(
            peer in address(),
            xff in prop::collection::vec(header_value(), 0..4),
            forwarded in prop::collection::vec(header_value(), 0..4),
        ) {
            let ex = behind_proxies();
            prop_assume!(!ex.is_trusted(canonical(peer)));
            let parts = with_headers(peer, &xff, &forwarded);
            for ex in [ex.clone(), ex.proxy_header(ProxyHeader::Forwarded)] {
                prop_assert_eq!(ex.client_ip(&parts), Ok(canonical(peer)));
                let alone = with_headers(peer, &[], &[]);
                prop_assert_eq!(ex.extract(&parts), ex.extract(&alone));
            }
        }
    }
}
